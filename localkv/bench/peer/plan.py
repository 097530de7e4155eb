"""What one run of the peer bench is given: the servers' setting, llama-server, the bounds.

Every measurement takes a ``Plan``: the ``Setting`` both servers share, the
llama-server binary, the folder for the servers' homes and logs, how many times each
figure is timed, the answers' bound in tokens and the bound on any one request.
``say`` prints one progress line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localkv.bench.peer.servers import Setting

__all__ = ["Plan", "say"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    setting: Setting
    llama_server: Path
    work: Path
    repeats: int  # runs of each figure (its median is the page's)
    max_tokens: int  # every answer's bound
    timeout_s: float  # every request's bound

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.max_tokens < 2 or self.timeout_s <= 0:
            raise ValueError("repeats >= 1, max_tokens >= 2 and a positive timeout are needed")


def say(part: str, line: str) -> None:
    """One progress line of the run, ``[part] line``."""
    print(f"[{part}] {line}", flush=True)
