"""The peer page from a run's JSON: the medians, the ratios localkv / llama-server, the targets.

The runs here are written by hand in the form the bench writes them, so each
ratio on the page is known in advance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from localkv.bench.peer.figures import (
    Target,
    alternate_figures,
    length_figures,
    restart_parts,
    targets,
)
from localkv.bench.peer.report import cell, markdown
from localkv.bench.peer.restart import parts
from localkv.bench.peer.run import main
from localkv.bench.stats import Stat


def _runs(key: str, values: list[float], **extra: Any) -> list[dict[str, Any]]:
    return [{key: v, "prompt_tokens": 2040, **extra} for v in values]


def _cold(ttft: list[float], cpu: list[float], rate: list[float]) -> list[dict[str, Any]]:
    return [
        {"ttft_s": t, "cpu_s": c, "decode_tok_s": r, "prompt_tokens": 2040}
        for t, c, r in zip(ttft, cpu, rate, strict=True)
    ]


# a restart's parts, in seconds, as ``restart.parts`` writes them
_PARTS = {
    "prompt": 0.005,
    "lookup": 0.002,
    "read": 0.02,
    "columns": 0.004,
    "load": 0.008,
    "probe": 0.006,
    "rest": 0.055,
}


def _length(tokens: int, *, restart: float, slot: float) -> dict[str, Any]:
    return {
        "tokens": tokens,
        "cold": {
            "localkv": _cold([10.0, 12.0, 11.0], [20.0, 21.0, 22.0], [50.0, 52.0, 51.0]),
            "llama-server": _cold([10.0, 10.0, 10.0], [20.0, 20.0, 20.0], [50.0, 50.0, 50.0]),
        },
        "restart": {
            "runs": {
                "localkv": _runs(
                    "ttft_s", [restart] * 3, server={"restore_ms": 40.0}, parts_s=_PARTS
                ),
                "llama-server slot": [
                    {"ttft_s": slot / 2, "restore_and_ttft_s": slot, "restore_s": slot / 2}
                ]
                * 3,
            },
            "disk": {
                "block_bytes": 2_000_000,
                "localkv_tokens": 2000,
                "slot_file_bytes": 4_000_000,
                "slot_tokens": 2000,
            },
        },
    }


def _data() -> dict[str, Any]:
    return {
        "command": "python -m localkv.bench.peer --tokens 2000 6000",
        "started": "2026-12-06 22:00 UTC",
        "seconds": 600.0,
        "load": {"before": [1.5, 1.2, 1.0], "after": [2.5, 2.0, 1.5]},
        "machine": {"cpu": "a CPU", "cores": 2, "memory_bytes": 8e9, "os": "Linux"},
        "model": {"name": "m.gguf", "file_bytes": 1e8},
        "setting": {"n_ctx": 6656, "threads": 2, "max_tokens": 32, "repeats": 3},
        "llama_server": {"path": "build/llama-server/bin/llama-server", "version": "version: 1"},
        "lengths": [
            _length(2000, restart=0.1, slot=0.1),  # level: met
            _length(6000, restart=0.4, slot=0.2),  # twice the slot's: not met
        ],
        "alternate": {
            "tokens": 2000,
            "runs": {
                "localkv": _runs("ttft_s", [0.2, 0.2]),
                "llama-server --cache-ram": _runs("ttft_s", [0.1, 0.1]),
                "llama-server -np 2": _runs("ttft_s", [0.4, 0.4]),
            },
        },
    }


def test_each_row_is_the_ratio_of_the_medians() -> None:
    rows = {(f.label, f.other): f for f in length_figures(_data()["lengths"][1])}
    assert rows[("cold: first token", "llama-server")].ratio == pytest.approx(1.1)
    assert rows[("cold: server CPU", "llama-server")].ratio == pytest.approx(1.05)
    assert rows[("cold: decode", "llama-server")].ratio == pytest.approx(1.02)
    assert rows[("restart: first token", "slot restore + request")].ratio == pytest.approx(2.0)
    assert rows[("restart: first token", "slot request alone")].ratio == pytest.approx(4.0)
    # llama-server's RAM cache is lost on a restart: its cold runs are the re-prefill
    assert rows[("restart: first token", "--cache-ram (re-prefill)")].ratio == pytest.approx(0.04)
    assert rows[("bytes on disk per token", "slot file")].ratio == pytest.approx(0.5)
    alt = {f.other: f.ratio for f in alternate_figures(_data()["alternate"]["runs"])}
    assert alt == {"llama-server --cache-ram": 2.0, "llama-server -np 2": 0.5}


def test_the_targets_say_which_ratios_were_met() -> None:
    found = {t.what: t.met for t in targets(_data())}
    assert found == {
        "2,000: restart first token / slot restore": True,
        "2,000: cold prefill CPU / llama-server's": True,
        "2,000: decode rate / llama-server's": True,
        "6,000: restart first token / slot restore": False,
        "6,000: cold prefill CPU / llama-server's": True,
        "6,000: decode rate / llama-server's": True,
        "2,000: two documents in turn / --cache-ram": False,
    }
    assert not Target(what="x", ratio=0.9, bound=0.95, higher_is_better=True).met
    assert not Target(what="x", ratio=None, bound=1.15).met


def test_the_page_names_the_command_the_load_and_every_table() -> None:
    page = markdown(_data())
    assert "python -m localkv.bench.peer --tokens 2000 6000" in page
    assert "before [1.5, 1.2, 1.0], after [2.5, 2.0, 1.5]" in page
    assert "### A document of 2,000 tokens" in page and "### A document of 6,000 tokens" in page
    assert "### Two documents of 2,000 tokens in turn" in page
    restart_rows = [r for r in page.splitlines() if r.startswith("| restart: first token | slot")]
    assert restart_rows[0].endswith("| 1x |") and restart_rows[2].endswith("| 2x |")
    assert "6,000: restart first token / slot restore: 2x (<= 1.15): NOT met" in page
    assert "2,000: decode rate / llama-server's: 1.02x (>= 0.95): met" in page
    assert "| bytes on disk per token | slot file | 1 kB/token | 2 kB/token | 0.5x |" in page


def test_a_restart_is_split_into_the_parts_the_server_reports() -> None:
    steps = {"lookup": 2.0, "read": 24.0, "columns": 4.0, "load": 8.0, "probe": 6.0}
    server = {"prompt_ms": 5.0, "restore_ms": 40.0, "restore_steps": steps}
    found = parts({"ttft_s": 0.1, "server": server})  # milliseconds in, seconds out
    assert found == pytest.approx(_PARTS)
    assert sum(found.values()) == pytest.approx(0.1)  # the client's first token, whole
    assert parts({"ttft_s": 0.1, "server": {"prompt_ms": 5.0, "source": "live"}}) == {}
    rows = {p.label: p for p in restart_parts(_data()["lengths"][1])}
    assert rows["restore: read, columns excluded"].localkv.median == pytest.approx(0.02)
    assert rows["restore: probe"].peer.n == 0  # llama-server names no such step
    assert rows["restore, all its steps"].localkv.median == pytest.approx(0.04)
    assert rows["restore, all its steps"].peer.median == pytest.approx(0.1)  # the slot call
    assert rows["the rest of the first token"].peer.median == pytest.approx(0.1)
    assert rows["first token, as the client saw it"].localkv.median == pytest.approx(0.4)
    page = markdown(_data())
    assert "## Where localkv's restart time goes" in page
    assert "### A document of 6,000 tokens, after a restart" in page
    assert "| restore: V into columns | 4 ms (4-4) | - |" in page
    assert "**the rest of the first token**" in page


def test_a_cell_prints_the_median_and_range_in_its_unit() -> None:
    assert cell(Stat.of([0.1, 0.2, 0.3]), "s") == "200 ms (100-300)"
    assert cell(Stat.of([50.0, 52.0, 51.0]), "tok/s") == "51 tok/s (50-52)"
    assert cell(Stat(median=0.0, min=0.0, max=0.0, n=0), "s") == "-"


def test_a_missing_llama_server_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--quick", "--llama-server", str(tmp_path / "none")])
    assert exit_.value.code == 2
    assert "make llama-server" in capsys.readouterr().err


def test_the_servers_get_no_openmp_wait_the_bench_chose_for_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from localkv.bench.peer import servers
    from localkv.model.native import CHOSEN_MARK

    monkeypatch.setenv("GOMP_SPINCOUNT", "3000")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv(CHOSEN_MARK, "OMP_WAIT_POLICY= GOMP_SPINCOUNT=3000")
    env = servers._environ()
    assert "GOMP_SPINCOUNT" not in env and CHOSEN_MARK not in env
    monkeypatch.delenv(CHOSEN_MARK)  # the user's own: both servers keep it
    assert servers._environ()["GOMP_SPINCOUNT"] == "3000"
