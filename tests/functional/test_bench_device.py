"""The device comparison's CPU side: one build's run, the page of two runs, the driver's checks.

The GPU build's run is the gpu set's business (``benchmarks/gpu_check.sh``); here
the CPU build measures the tiny model, and the page is made of that run twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from support.tinymodels import TinyModels

from localkv.bench.device.measure import MeasureConfig, measure
from localkv.bench.device.report import markdown, verified
from localkv.bench.device.run import build_env, main


@pytest.fixture(scope="module")
def run(tiny_models: TinyModels) -> dict[str, Any]:
    cfg = MeasureConfig(
        model_path=tiny_models.base, sizes=(300, 600), repeats=2, cold_repeats=1, n_threads=1
    )
    return measure(cfg)


def test_one_build_measures_a_verified_restore_and_its_bytes(run: dict[str, Any]) -> None:
    assert run["build"]["backend"] == "cpu"
    assert [x["tokens"] for x in run["lengths"]] == [300, 600]
    for x in run["lengths"]:
        assert x["verified"] and x["first_token_agrees"]
        assert x["cold"]["n"] == 1 and x["restore"]["n"] == x["ttft"]["n"] == 2
        assert x["ttft"]["median"] >= x["restore"]["median"] > 0
        # every block file read, none twice (the index's pages come on top)
        assert x["stored_bytes"] <= x["bytes_read"] < 2 * x["stored_bytes"]
        assert x["state_bytes"] > 0 and x["blocks"] >= 1
        assert {"lookup", "read", "load", "probe"} <= set(x["steps"])
    assert verified(run)


def test_the_page_holds_both_runs_the_ratios_and_the_command(run: dict[str, Any]) -> None:
    page = markdown(run, run, "python -m localkv.bench.device --sizes 300,600", ["a note"])
    assert "python -m localkv.bench.device --sizes 300,600" in page
    assert "300: device/CPU" in page and "600: device/CPU" in page
    table = [line for line in page.splitlines() if line.startswith("| cold")]
    assert table and table[0].count("1x") == 2  # a run against itself
    assert "NOT VERIFIED" not in page and "- a note" in page
    bad = json.loads(json.dumps(run))
    bad["lengths"][0]["verified"] = False
    assert not verified(bad)
    assert "NOT VERIFIED" in markdown(run, bad, "cmd")


def test_the_cpu_build_has_no_library_path_and_the_gpu_build_its_own(tmp_path: Path) -> None:
    assert "LLAMA_CPP_LIB_PATH" not in build_env(None)
    env = build_env(tmp_path)
    assert env["LLAMA_CPP_LIB_PATH"] == str(tmp_path.resolve())
    assert env["GGML_VK_VISIBLE_DEVICES"]


def test_a_gpu_build_that_offloads_nothing_is_refused(
    tiny_models: TinyModels, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cpu_lib = Path(llama_cpp.__file__).parent / "lib"
    page = tmp_path / "device.md"
    args = ["--gpu-lib", str(cpu_lib), "--model", str(tiny_models.base), "--sizes", "300"]
    args += ["--repeats", "1", "--cold-repeats", "1", "--threads", "1", "--write-docs", str(page)]
    assert main(args) == 2
    assert "offloaded nothing" in capsys.readouterr().err
    assert not page.exists()


def test_a_missing_gpu_build_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--gpu-lib", str(tmp_path / "none")])
    assert exit_.value.code == 2
    assert "run make gpu-build" in capsys.readouterr().err
