"""The cache at Gemma 3 12B's real cache geometry, through the CLI (``-m geometry``).

A random-weight model with Gemma 3 12B's memory (48 layers, 40 sliding over
1,024 tokens, 8 KV heads of 256 dims; ``localkv.bench.geometry``), each step a
process of its own, over a ~2,400-token document: past the window and two
blocks beyond it. A cached answer equals ``--no-cache`` token for token after
prefill then ask, for a document changed midway, for the same document after
another system prompt, and for a 3-turn chat resumed; a flipped byte in a row
a restore uses (a sliding tail row, a full-attention row) is a miss, never a
wrong answer. Minutes on two cores, so skipped unless ``-m geometry``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from localkv.bench.geometry.models import build
from localkv.bench.geometry.shapes import by_name

pytestmark = [
    pytest.mark.geometry,
    pytest.mark.skipif(
        "'geometry' not in (config.getoption('markexpr') or '')",
        reason="the 12B-geometry run takes minutes: pytest -m geometry",
    ),
]

WAIT_S = 1800  # liveness only
BLOCK, WINDOW = 256, 1024
SYSTEM = "Answer from the document."
QUESTION = "What was Alice doing?"
TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of "
    "having nothing to do: once or twice she had peeped into the book her sister was reading. "
)
RULES = " ".join(f"Rule {i}: quote the document exactly and say where." for i in range(40))
SEEDED = ("--temperature", "1", "--seed", "3", "--max-tokens", "32")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    where = tmp_path_factory.mktemp("gemma-12b")
    return build(by_name("gemma-3-12b"), where / "gemma-3-12b.gguf", default_model_path)


def _doc(where: Path, changed_at: int | None = None) -> Path:
    chapters = [f"Chapter {i}. {TEXT}" for i in range(60)]
    if changed_at is not None:
        chapters[changed_at] = f"Chapter {changed_at}. The Queen of Hearts shouted at everyone."
    path = where / ("doc.txt" if changed_at is None else f"doc-{changed_at}.txt")
    path.write_text(" ".join(chapters), encoding="utf-8")
    return path


def _cli(home: Path, model: Path, *args: str) -> dict[str, Any]:
    env = {**os.environ, "LOCALKV_HOME": str(home)}
    env.pop("LOCALKV_MODEL", None)
    command = [sys.executable, "-m", "localkv", *args, "--json", "--model", str(model)]
    command += ["--threads", "1", "--ctx", "4096"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _ask(home: Path, model: Path, doc: Path, *extra: str) -> dict[str, Any]:
    return _cli(home, model, "ask", str(doc), QUESTION, *SEEDED, *extra)


def _same_answer(cached: dict[str, Any], uncached: dict[str, Any]) -> None:
    assert uncached["tokens"]["reused"] == 0
    assert cached["tokens"]["generated"] == uncached["tokens"]["generated"]
    assert cached["answer"] == uncached["answer"]


@pytest.fixture(scope="module")
def prefilled(model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """A home holding the document prefilled behind ``SYSTEM``: (home, document, tokens)."""
    where = tmp_path_factory.mktemp("prefilled")
    doc, home = _doc(where), where / "home"
    pre = _cli(home, model, "prefill", "--system", SYSTEM, str(doc))
    n = int(pre["tokens"])
    assert n >= WINDOW + 2 * BLOCK + 1024 and pre["kept"] == n
    return home, doc, n


@pytest.fixture(scope="module")
def uncached(model: Path, prefilled: tuple[Path, Path, int]) -> dict[str, Any]:
    home, doc, _ = prefilled
    return _ask(home, model, doc, "--system", SYSTEM, "--no-cache")


def _copy(home: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    return copy


def test_prefill_then_ask_reuses_the_whole_document_and_answers_as_uncached(
    model: Path, prefilled: tuple[Path, Path, int], uncached: dict[str, Any], tmp_path: Path
) -> None:
    home, doc, n = prefilled
    cached = _ask(_copy(home, tmp_path), model, doc, "--system", SYSTEM)
    assert cached["cache"]["verified"] is True and cached["tokens"]["reused"] == n
    _same_answer(cached, uncached)


def test_a_document_changed_midway_reuses_the_blocks_before_the_change(
    model: Path, prefilled: tuple[Path, Path, int], tmp_path: Path
) -> None:
    home, _, n = prefilled
    changed = _doc(tmp_path, changed_at=40)
    cached = _ask(_copy(home, tmp_path), model, changed, "--system", SYSTEM)
    reused = cached["tokens"]["reused"]
    assert cached["cache"]["verified"] is True
    assert WINDOW + BLOCK <= reused < n  # past the window, and not past the change
    _same_answer(cached, _ask(tmp_path / "none", model, changed, "--system", SYSTEM, "--no-cache"))


def test_a_shifted_document_reuses_only_the_common_prefix(model: Path, tmp_path: Path) -> None:
    doc, home = _doc(tmp_path), tmp_path / "home"
    first, second = f"{RULES} Answer briefly.", f"{RULES} Answer in detail, and politely."
    n = int(_cli(home, model, "prefill", "--system", first, str(doc))["tokens"])
    cached = _ask(home, model, doc, "--system", second)
    assert cached["cache"]["verified"] is True
    assert BLOCK <= cached["tokens"]["reused"] < n // 2  # the system prompt's blocks only
    _same_answer(cached, _ask(home, model, doc, "--system", second, "--no-cache"))


def _block(home: Path, start: int) -> tuple[Path, int]:
    """The longest block file starting at ``start`` and the position it ends at."""
    conn = sqlite3.connect(home / "index.db")
    try:
        ((file, end),) = conn.execute(
            "SELECT file, start + n_tokens FROM blocks WHERE start = ? "
            "ORDER BY n_tokens DESC LIMIT 1",
            (start,),
        ).fetchall()
    finally:
        conn.close()
    return home / file, int(end)


def _flip(path: Path, tensor: str, row_of: int | None = None, end: int = 0) -> None:
    """Flip a byte of ``tensor`` in a block file: in the row of position ``row_of`` (a tail
    tensor, whose rows end at the block's ``end``), else in its middle."""
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", data, 0)
    spec = json.loads(data[8 : 8 + n])[tensor]
    lo, hi = spec["data_offsets"]
    at = (lo + hi) // 2
    if row_of is not None:
        rows, row_bytes = spec["shape"][0], (hi - lo) // spec["shape"][0]
        index = row_of - (end - rows)
        assert 0 <= index < rows
        at = lo + index * row_bytes + row_bytes // 2
    data[8 + n + at] ^= 0x20
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["sliding tail row", "full-attention row"])
def test_a_flipped_byte_in_a_row_the_restore_uses_is_a_miss(
    where: str,
    model: Path,
    prefilled: tuple[Path, Path, int],
    uncached: dict[str, Any],
    tmp_path: Path,
) -> None:
    home, doc, n = prefilled
    home = _copy(home, tmp_path)
    if where == "sliding tail row":
        tip = (n - 1) // BLOCK * BLOCK
        path, end = _block(home, tip)
        _flip(path, "w.v.0", end - 3, end)  # inside the window the restore assembles
        damaged = tip
    else:
        damaged = 4 * BLOCK
        _flip(_block(home, damaged)[0], "k.0")
    cached = _ask(home, model, doc, "--system", SYSTEM)
    assert cached["tokens"]["reused"] <= damaged
    assert "corrupt" in (cached["cache"]["miss_reason"] or ""), cached["cache"]
    _same_answer(cached, uncached)


def _chat(home: Path, model: Path, text: str, *args: str) -> str:
    env = {**os.environ, "LOCALKV_HOME": str(home)}
    env.pop("LOCALKV_MODEL", None)
    command = [sys.executable, "-m", "localkv", "chat", "--plain", "--model", str(model)]
    command += ["--threads", "1", "--ctx", "4096", "--max-tokens", "24", *SEEDED[:4]]
    done = subprocess.run(
        [*command, *args], input=text, env=env, capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + "\n--stderr--\n" + done.stderr


def test_a_three_turn_chat_resumed_answers_as_uncached(
    model: Path, prefilled: tuple[Path, Path, int], tmp_path: Path
) -> None:
    _, doc, _ = prefilled
    home = tmp_path / "home"
    turns = "Who is Alice?\nWhere does she sit?\nWhat is in the book?\n/quit\n"
    _chat(home, model, turns, "--system", RULES, "--doc", str(doc))
    uncached_home = tmp_path / "uncached"
    shutil.copytree(home, uncached_home)
    question = "And what did she do next?\n/quit\n"
    resumed = _chat(home, model, question, "--resume")
    match = re.search(r"resumed “Who is Alice\?”: restored ([\d,]+) tokens \(verified\)", resumed)
    assert match is not None, resumed
    assert int(match.group(1).replace(",", "")) > WINDOW + 2 * BLOCK
    plain = _chat(uncached_home, model, question, "--resume", "--no-cache")
    assert "cache disabled" in plain
    answer, plain_answer = resumed.split("\n--stderr--\n")[0], plain.split("\n--stderr--\n")[0]
    assert answer.strip() and answer == plain_answer
