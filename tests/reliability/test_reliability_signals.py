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
import random
import re
import signal
import sqlite3
import subprocess
import sys
import threading
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


def test_a_kill_at_a_random_moment_keeps_every_block_completed_a_batch_before_it(
    tmp_path: Path, doc: Path, default_model_path: Path
) -> None:
    """SIGKILL lands anywhere in the prefill; what was computed one batch earlier survives.

    ``-v`` makes the prefill log each block it has computed. The kill comes at
    a random time between the second block and about eight blocks later; every
    block logged before the last one logged had a whole batch's time for its
    background save, so a new process must restore at least up to it.
    """
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    cache = tmp_path / "cache"
    env = {**os.environ, "LOCALKV_HOME": str(cache)}
    env.pop("LOCALKV_MODEL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "localkv", "-v", "prefill", "--json", str(doc)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    computed: list[tuple[float, int]] = []
    reader = threading.Thread(target=_read_computed, args=(proc, computed), daemon=True)
    reader.start()
    deadline = time.monotonic() + WAIT_S
    while len(computed) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(computed) >= 2, f"the prefill logged no two blocks (seed {seed})"
    per_block = computed[1][0] - computed[0][0]
    time.sleep(rng.uniform(0.0, 8.0 * per_block))
    proc.kill()
    proc.wait(timeout=WAIT_S)
    reader.join(timeout=WAIT_S)
    seen = [position for _, position in computed]
    assert proc.returncode == -signal.SIGKILL, f"it ended before the kill (seed {seed}): {seen}"
    safe = seen[-2]  # the last one logged may still be in its save
    with Runtime.open(default_model_path, cache_dir=cache) as rt:
        request = rt.build([read_document(doc)], system=None)
        assert rt.cache is not None
        result = rt.cache.restore(rt.session, request.tokens, rt.schedule(request))
    assert result.verified is True, f"seed {seed}"
    assert result.reused >= safe, f"seed {seed}: computed {seen}, restored {result.reused}"
    print(f"seed {seed}: computed {seen}, restored {result.reused}")


def _read_computed(proc: subprocess.Popen[str], into: list[tuple[float, int]]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        match = re.search(r"prefill: (\d+) of \d+ tokens computed", line)
        if match:
            into.append((time.monotonic(), int(match.group(1))))
