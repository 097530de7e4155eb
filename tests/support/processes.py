"""A ``localkv`` command run as a process of its own, to its end or stopped at a point
of its work."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def run_localkv(
    env: dict[str, str], *args: str, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """``python -m localkv ARGS`` to its end, with no input; what it printed."""
    return subprocess.run(
        [sys.executable, "-m", "localkv", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def run_until_a_block_is_saved(
    env: dict[str, str], args: list[str], liveness_s: float
) -> subprocess.Popen[str]:
    """Start ``localkv ARGS`` and return once a block file is in the cache (or it ended).

    The cache is ``env["LOCALKV_HOME"]``; ``liveness_s`` only guards against a hang.
    """
    cache = Path(env["LOCALKV_HOME"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "localkv", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + liveness_s
    while not list(cache.glob("blocks/*/*.lkv")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no block was saved"
        time.sleep(0.005)
    return proc
