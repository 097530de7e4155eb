"""Inputs that are not ordinary files never hang or exhaust memory; UTF-16 is text.

Documents, ``--system @FILE`` and block files are opened without blocking
(a FIFO has no writer here) and checked to be regular files before a byte is
read; documents are read only up to what the context can hold. Each command
runs in its own process with a timeout, so a hang fails the test instead of
stalling the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from localkv.storage.store import SnapshotStore
from support.tinymodels import TinyModels

from localkv.prompt.request import byte_limit, read_document

LIVENESS_S = 60  # far beyond what a refusal takes; only a hang reaches it


@pytest.fixture()
def env(tmp_path: Path, tiny_models: TinyModels) -> dict[str, str]:
    return {
        **os.environ,
        "LOCALKV_MODEL": str(tiny_models.base),
        "LOCALKV_HOME": str(tmp_path / "cache"),
    }


def _localkv(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "localkv", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=LIVENESS_S,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/urandom"])
def test_a_document_that_is_no_regular_file_is_refused_at_once(
    env: dict[str, str], tmp_path: Path, kind: str
) -> None:
    source = tmp_path / "doc.fifo" if kind == "fifo" else Path(kind)
    if kind == "fifo":
        os.mkfifo(source)
    done = _localkv(env, "ask", "--threads", "1", str(source), "What is it?")
    assert done.returncode == 1
    assert "not a regular file" in done.stderr


def test_a_system_prompt_file_that_is_a_device_is_refused(
    env: dict[str, str], tmp_path: Path
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document.", encoding="utf-8")
    done = _localkv(env, "prefill", "--threads", "1", "--system", "@/dev/zero", str(doc))
    assert done.returncode == 2
    assert "not a regular file" in done.stderr


def test_a_document_larger_than_the_context_can_hold_is_refused_before_reading(
    env: dict[str, str], tmp_path: Path
) -> None:
    big = tmp_path / "big.txt"
    with big.open("wb") as f:  # sparse: the size says it all, nothing needs reading
        f.truncate(byte_limit(2048) + 1)
    done = _localkv(env, "prefill", "--threads", "1", "--ctx", "2048", str(big))
    assert done.returncode == 1
    assert "more text than the context can hold" in done.stderr


def test_utf16_with_a_byte_order_mark_is_read_as_text(tmp_path: Path, long_text: str) -> None:
    text = long_text[:500] + " ünïcode ✓"
    for encoding in ("utf-16-le", "utf-16-be"):
        path = tmp_path / f"{encoding}.txt"
        bom = b"\xff\xfe" if encoding.endswith("le") else b"\xfe\xff"
        path.write_bytes(bom + text.encode(encoding))
        doc = read_document(path)
        assert (doc.text, doc.encoding) == (text, "utf-16")


def test_a_fifo_in_place_of_a_block_file_is_a_miss_not_a_hang(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(long_text[:3000], encoding="utf-8")
    assert _localkv(env, "prefill", "--threads", "1", str(doc)).returncode == 0
    with SnapshotStore.open(tmp_path / "cache") as store:
        (snap,) = store.snapshots()
        target = store.root / store.chain_of(snap.tip)[0].file
    target.unlink()
    os.mkfifo(target)
    verify = _localkv(env, "cache", "verify", "--json")
    assert "not a regular file" in verify.stdout
    ask = _localkv(env, "ask", "--threads", "1", "--json", str(doc), "What is it?")
    assert ask.returncode == 0, ask.stderr
    assert '"reused": 0' in ask.stdout and "not a regular file" in ask.stdout
