"""The sliding-window bench's page: the ratio, the target and localkv's own steps it reports."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import swa_followup


def _result(ours: list[float], peer: list[float]) -> dict[str, Any]:
    def request(kind: str, run: int) -> dict[str, Any]:
        row: dict[str, Any] = {"server": kind, "run": run, "prompt_tokens": 2026, "cached": 2013}
        if kind == "localkv":
            steps = {"lookup": 1.0, "read": 10.0, "load": 3.0, "probe": 17.0 + run}
            row |= {"source": "disk", "restore_steps": steps, "prompt_ms": 8.0, "ttft_ms": 100.0}
        return row

    requests = [request(kind, run) for run in range(3) for kind in ("localkv", "llama-server")]
    return {
        "model": "/models/gemma.gguf",
        "threads": 2,
        "ctx": 4096,
        "tokens": 2000,
        "runs": 3,
        "load_1min": [0.5, 1.5],
        "seconds": {
            "localkv": {"followup": ours, "alternate": ours},
            "llama-server": {"followup": peer, "alternate": [10 * x for x in peer]},
        },
        "requests": {"followup": requests, "alternate": requests},
    }


@pytest.mark.parametrize(
    ("ours", "verdict"), [([0.11, 0.12, 0.5], "1.20x | <= 1.2x (met)"), ([0.13] * 3, "1.30x")]
)
def test_the_page_gives_the_ratio_of_the_medians_and_the_target(
    ours: list[float], verdict: str
) -> None:
    page = swa_followup.page(_result(ours, [0.1, 0.09, 0.2]), "cmd", {"cpu": "x", "cores": 2})
    (followup,) = [line for line in page.splitlines() if line.startswith("| followup |")]
    assert verdict in followup
    assert ("(not met)" in followup) == (verdict == "1.30x")
    assert "| alternate |" in page and "(met)" in page.split("| alternate |")[1]
    assert "restore: lookup 1, read 10, load 3, probe 18 ms" in page  # medians of the runs
    assert "2026; 2026" in followup and "2013; 2013" in followup
