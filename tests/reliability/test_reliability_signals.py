"""A prefill stopped by a signal, or killed, keeps the blocks it completed.

Blocks are saved as the prefill goes (in the background), so the index holds
the first blocks long before the document ends. A ``prefill`` of about 3,000
tokens on the default model gets a signal once two blocks are in the index:
SIGTERM and SIGHUP stop it after the current batch with exit 143 and 129 and
keep what is complete; SIGKILL keeps what was written, and a new process
restores it, verified.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localkv.prompt.request import read_document
from localkv.runtime import Runtime

pytestmark = pytest.mark.default_model
WAIT_S = 300  # liveness only


def _blocks(cache: Path) -> int:
    db = cache / "index.db"
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM blocks").fetchone()[0])
    except sqlite3.Error:
        return 0


def _prefill_until(cache: Path, doc: Path, blocks: int) -> subprocess.Popen[str]:
    env = {**os.environ, "LOCALKV_HOME": str(cache)}
    env.pop("LOCALKV_MODEL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "localkv", "prefill", "--json", str(doc)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + WAIT_S
    while _blocks(cache) < blocks:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {blocks} blocks in the index while the prefill ran: {proc.stderr}")
        time.sleep(0.05)
    return proc


@pytest.fixture()
def doc(tmp_path: Path, long_text: str) -> Path:
    path = tmp_path / "doc.txt"
    path.write_text(long_text[:13000], encoding="utf-8")
    return path


@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_signal_stops_the_prefill_and_keeps_what_is_complete(
    tmp_path: Path, doc: Path, name: str, code: int
) -> None:
    cache = tmp_path / "cache"
    proc = _prefill_until(cache, doc, 2)
    proc.send_signal(getattr(signal, name))
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == code, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["cancelled"] is True
    assert 512 <= report["prefilled"] < report["tokens"]
    assert _blocks(cache) >= report["prefilled"] // 256


def test_a_killed_prefill_keeps_the_blocks_it_wrote(
    tmp_path: Path, doc: Path, default_model_path: Path
) -> None:
    cache = tmp_path / "cache"
    proc = _prefill_until(cache, doc, 2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=WAIT_S)
    with Runtime.open(default_model_path, cache_dir=cache) as rt:
        request = rt.build([read_document(doc)], system=None)
        assert rt.cache is not None
        result = rt.cache.restore(rt.session, request.tokens, rt.schedule(request))
    assert result.verified is True
    assert result.reused >= 512
