"""The peer bench end to end: localkv and llama-server, its quick mode, on the default model.

It needs llama.cpp's own server, built by ``make llama-server``; without it the
test is skipped and says so. Minutes on two cores, so it runs only when asked for:
``.venv/bin/python -m pytest -m peer tests/functional/test_bench_peer.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localkv.bench.peer.figures import PART_LABELS
from localkv.bench.peer.restart import PARTS
from localkv.bench.peer.run import LLAMA_SERVER, main

REPO = Path(__file__).resolve().parents[2]
BINARY = REPO / LLAMA_SERVER

pytestmark = [
    pytest.mark.peer,
    pytest.mark.default_model,
    pytest.mark.skipif(
        "'peer' not in (config.getoption('markexpr') or '')",
        reason="the peer bench starts each server a dozen times: pytest -m peer",
    ),
    pytest.mark.skipif(
        not BINARY.is_file(), reason=f"no llama-server at {BINARY}: run make llama-server"
    ),
]


def test_the_quick_run_writes_the_page_and_every_figure(
    tmp_path: Path, default_model_path: Path
) -> None:
    page = tmp_path / "peer.md"
    args = ["--quick", "--llama-server", str(BINARY), "--model", str(default_model_path)]
    assert main([*args, "--max-tokens", "8", "--write-docs", str(page)]) == 0
    data = json.loads(page.with_suffix(".json").read_text())
    (length,) = data["lengths"]
    assert [len(length["cold"][who]) for who in ("localkv", "llama-server")] == [2, 2]
    for run in length["cold"]["localkv"]:
        assert run["server"]["source"] == "none" and run["cpu_s"] > 0
    for run in length["cold"]["llama-server"]:
        assert run["server"]["prompt_n"] == run["prompt_tokens"] > 300  # all of it prefilled
    restart = length["restart"]["runs"]
    for run in restart["localkv"]:  # from its disk cache, verified, step by step
        assert run["server"]["source"] == "disk" and run["server"]["verified"] is True
        assert run["server"]["cached_tokens"] >= 256
        assert {"lookup", "read", "load", "probe"} <= set(run["server"]["restore_steps"])
        assert list(run["parts_s"]) == list(PARTS)
        assert sum(run["parts_s"].values()) == pytest.approx(run["ttft_s"])
    for run in restart["llama-server slot"]:  # the restored slot serves the prompt
        assert run["restored_tokens"] > 300 and run["server"]["cache_n"] >= 300
    disk = length["restart"]["disk"]
    assert disk["block_bytes"] > 0 and disk["slot_file_bytes"] > 0
    alternate = data["alternate"]["runs"]
    assert {who: len(runs) for who, runs in alternate.items()} == {
        "localkv": 4,
        "llama-server --cache-ram": 4,
        "llama-server -np 2": 4,
    }
    for run in alternate["localkv"]:  # each document's prefix came back from the cache
        assert run["server"]["cached_tokens"] >= 256
    text = page.read_text()
    assert "### A document of 300 tokens" in text and "## Targets" in text
    assert "load average" in text
    assert "## Where localkv's restart time goes" in text
    section = text.split("## Where localkv's restart time goes")[1].split("## Targets")[0]
    rows = [line.split(" | ")[0].lstrip("| ") for line in section.splitlines() if "|" in line]
    assert set(PART_LABELS.values()) <= set(rows)  # a row per part, and llama-server's beside
    assert "restore, all its steps" in rows
