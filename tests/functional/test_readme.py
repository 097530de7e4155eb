"""A newcomer follows the README and the manual: every command block runs as written.

Each ```sh, ```console or ```python block of README.md and of every page under
docs/ is a command block (a synopsis with placeholders is ```text, and so is a
log line); each is a test of its own, named by its page and line. Either it
runs here, in a fresh ``LOCALKV_HOME`` from the repository root, with the
venv activated as the README says, and every command exits 0; or the line
before it is ``<!-- not run: REASON -->``, saying why a test cannot run it
(it opens the chat app, it builds everything again, it needs a GPU, it runs
a server until stopped). A block after ``<!-- run against a server: ... -->``
is a client's: it runs against a real ``localkv serve`` on the tiny model,
its ``http://127.0.0.1:8000`` that server's address. A ```console block shows
what a command prints: its ``$ `` lines are run, and every line it shows after
one must be printed by that command, numbers, sizes, times and ids aside (they
differ from run to run). A ```python block whose last line is a comment shows
the last line it prints, numbers aside. A model's greedy words depend on the
arithmetic of the llama.cpp build (its instruction sets), so a console block
whose answer came from one build has ``<!-- model text from a build whose
system info is: INFO -->`` before it: on that build every line is compared;
on another the lines the command prints to stdout (the answer) are counted,
not compared. Every relative link of those pages names a file that exists, and
a ``#fragment`` one of its headings.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest
from support.server import ServerProcess
from support.tinymodels import TinyModels

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]
SKIP = re.compile(r"<!-- not run: (.+?) -->")
SERVED = re.compile(r"<!-- run against a server: (.+?) -->")
BUILT = re.compile(r"<!-- model text from a build whose system info is: (.+?) -->")
README_SERVER = "http://127.0.0.1:8000"
COMMAND_LANGS = ("sh", "console", "python")
WAIT_S = 600  # liveness only


@dataclass(frozen=True)
class Block:
    page: str  # the page's path from the repository root
    line: int  # where its fence opens, 1-based
    lang: str
    text: str
    skip: str | None  # the reason a test does not run it
    served: bool = False  # a client's: it runs against a real server
    build: str | None = None  # llama.cpp's system info where its model text came from


def blocks(markdown: str, page: str = "README.md") -> list[Block]:
    """The fenced command blocks of ``markdown``, with any ``not run`` reason before them."""
    found: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.search(before)
        if fence.group(1) in COMMAND_LANGS:
            text = "\n".join(lines[i + 1 : end])
            reason = skip.group(1) if skip else None
            served = SERVED.search(before) is not None
            built = BUILT.search(before)
            build = " ".join(built.group(1).split()) if built else None
            found.append(
                Block(page, i + 1, fence.group(1), text, reason, served=served, build=build)
            )
        i = end + 1
    return found


def _normal(line: str) -> str:
    """A printed line without what varies between runs: ids, numbers, units of size."""
    line = re.sub(r"\b(?=[a-f]*\d)[0-9a-f]{8,64}\b", "ID", line.strip())  # ids, short too
    line = re.sub(r"\d[\d,]*(\.\d+)?", "N", line)
    return re.sub(r"N\s*(B|KiB|MiB|GiB|kB|MB|GB)\b", "N SIZE", line)


def _console(text: str) -> list[tuple[str, list[str]]]:
    """(command, the lines shown after it) of a console block; lines before any ``$`` go."""
    runs: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            runs.append((line[2:], []))
        elif runs and line.strip():
            runs[-1][1].append(line)
    return runs


def _shell(script: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALKV_")}
    env |= {"LOCALKV_HOME": str(home), "COLUMNS": "80"}
    venv = Path(sys.executable).parent.parent  # the README's `source .venv/bin/activate`
    prologue = f"set -e\nsource {venv}/bin/activate\n"
    return subprocess.run(
        ["bash", "-c", prologue + script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        stdin=subprocess.DEVNULL,
    )


def _page(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


ALL = [b for path in PAGES for b in blocks(path.read_text(encoding="utf-8"), _page(path))]


def _id(block: Block) -> str:
    return f"{block.page}:L{block.line}"


def test_the_readme_has_command_blocks_and_every_skip_says_why() -> None:
    assert len([b for b in ALL if b.page == "README.md"]) >= 5
    for block in ALL:
        assert block.skip is None or len(block.skip.split()) >= 3, block


def _run_script(block: Block, home: Path, text: str | None = None) -> None:
    """Run a sh or python block; a python block ending in a comment prints that line last."""
    text = block.text if text is None else text
    script = text if block.lang == "sh" else f"python - <<'PY'\n{text}\nPY"
    done = _shell(script, home)
    assert done.returncode == 0, f"{block.page} line {block.line}:\n{done.stdout}\n{done.stderr}"
    last = text.rstrip().splitlines()[-1].strip()
    if block.lang == "python" and last.startswith("# "):
        printed = done.stdout.rstrip().splitlines()
        assert printed and _normal(printed[-1]) == _normal(last[2:]), (
            f"{block.page} line {block.line}: the last line printed is not `{last[2:]}`:\n"
            + done.stdout
        )


RUN_HERE = [b for b in ALL if b.skip is None and not b.served]


def _this_build() -> str:
    from localkv.model.native import system_info

    return " ".join(system_info().split())


def _missing(block: Block, shown: list[str], done: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines ``shown`` that the command did not print (see the module's docstring)."""
    printed = {_normal(line) for line in (done.stdout + done.stderr).splitlines()}
    missing = [line for line in shown if _normal(line) not in printed]
    if not missing or block.build is None or block.build == _this_build():
        return missing
    logged = {_normal(line) for line in done.stderr.splitlines()}
    answer = [line for line in shown if _normal(line) not in logged]
    said = [line for line in done.stdout.splitlines() if line.strip()]
    return [] if len(answer) == len(said) else missing


@pytest.mark.default_model
@pytest.mark.parametrize("block", RUN_HERE, ids=_id)
def test_a_readme_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    home = tmp_path / "home"
    if block.lang in ("sh", "python"):
        _run_script(block, home)
        return
    runs = _console(block.text)
    assert runs, f"{block.page} line {block.line}: a console block without a `$ ` command"
    for command, shown in runs:
        done = _shell(command, home)
        where = f"{block.page} line {block.line}, `{command}`"
        assert done.returncode == 0, f"{where}:\n{done.stdout}\n{done.stderr}"
        missing = _missing(block, shown, done)
        assert not missing, (
            f"{where} did not print:\n"
            + "\n".join(missing)
            + (f"\n--- it printed:\n{done.stdout}{done.stderr}")
        )


SERVED_PAGES = sorted({b.page for b in ALL if b.served})


def test_the_client_examples_are_python_or_shell_clients() -> None:
    assert {b.lang for b in ALL if b.served} <= {"python", "sh"}
    assert any(b.served for b in ALL if b.page == "README.md")


@pytest.mark.parametrize("page", SERVED_PAGES)
def test_the_client_examples_run_against_a_real_server(
    page: str, tmp_path: Path, tiny_models: TinyModels
) -> None:
    clients = [b for b in ALL if b.served and b.page == page]
    assert all(README_SERVER in b.text for b in clients)
    args = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "4096"]
    with ServerProcess(args, tmp_path / "server.log") as proc:
        for block in clients:
            _run_script(block, tmp_path / "home", block.text.replace(README_SERVER, proc.base_url))


def test_on_another_build_the_answer_is_counted_and_the_log_still_compared() -> None:
    shown = ["The words of one build.", "reused 5 of 6 tokens (verified) in 9 ms"]
    log = "reused 7 of 8 tokens (verified) in 3 ms\n"
    other = Block("README.md", 1, "console", "", None, build="CPU : NO_SUCH_BUILD = 1 |")
    assert _missing(other, shown, subprocess.CompletedProcess([], 0, "Other words.\n", log)) == []
    two = subprocess.CompletedProcess([], 0, "Other words.\nMore.\n", log)
    assert _missing(other, shown, two) == ["The words of one build."]
    lost = subprocess.CompletedProcess([], 0, "Other words.\n", "no cache line\n")
    assert _missing(other, shown, lost) == shown
    here = Block("README.md", 1, "console", "", None, build=_this_build())
    said = subprocess.CompletedProcess([], 0, "Other words.\n", log)
    assert _missing(here, shown, said) == ["The words of one build."]


LINK = re.compile(r"\[[^\]\n]*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def _fenceless(markdown: str) -> str:
    return re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)


def _prose(markdown: str) -> str:
    """``markdown`` without its fenced blocks and code spans, where a link is only text."""
    return re.sub(r"`[^`\n]*`", "", _fenceless(markdown))


def _anchors(markdown: str) -> set[str]:
    """The ``#fragment`` of each heading, as GitHub makes them (a repeat gets ``-1``...)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _fenceless(markdown), re.M):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(f"{slug}-{count}" if count else slug)
    return anchors


def _broken(markdown: str, page: Path) -> list[str]:
    """The relative links of ``markdown`` (read at ``page``) that name no file or heading."""
    broken = []
    for target in LINK.findall(_prose(markdown)):
        if SCHEME.match(target):
            continue
        path, _, fragment = unquote(target).partition("#")
        file = (page.parent / path).resolve()
        if path and not file.exists():
            broken.append(target)
        elif fragment and (not path or file.suffix == ".md"):
            text = file.read_text(encoding="utf-8") if path else markdown
            if fragment not in _anchors(text):
                broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=_page)
def test_every_relative_link_names_a_file_and_heading_that_exist(page: Path) -> None:
    assert _broken(page.read_text(encoding="utf-8"), page) == []


def test_a_link_to_a_missing_file_or_heading_is_broken() -> None:
    text = (
        "# Top\n## A `b` c?\n[ok](README.md) [ok](#a-b-c) [web](https://x.example/none.md)\n"
        "[gone](guide/none.md) [gone](#nowhere) [gone](README.md#nowhere)\n"
        "```sh\n[not a link](none.md)\n```\n`[not a link](none.md)`\n"
    )
    assert _broken(text, README) == ["guide/none.md", "#nowhere", "README.md#nowhere"]


def test_the_readme_is_a_front_door_with_a_table_of_contents() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    sections = re.findall(r"^## (.+)$", _fenceless(text), re.M)
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- \[(.+?)\]\(#", contents, re.M)
    assert listed == [s for s in sections if s != "Contents"]
