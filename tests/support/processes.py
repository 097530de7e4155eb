"""A ``localkv`` command run as a process of its own, stopped at a point of its work."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


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
