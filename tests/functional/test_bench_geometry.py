"""The geometry benchmark: synthetic models with real cache geometry, and its figures.

Each geometry's GGUF loads in llama.cpp with the real model's layers, KV
heads, window and recurrent state, byte for byte per token; the benchmark,
run small through ``Runtime``, measures the Gemma 3 12B geometry storing
every row once and a restore reading what it needs (the issue's done-when,
on measured bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localkv.bench.geometry.measure import measure
from localkv.bench.geometry.models import build
from localkv.bench.geometry.run import main
from localkv.bench.geometry.shapes import GEOMETRIES, Geometry, by_name
from localkv.kv.partial import PARTIAL_ONLY
from localkv.model.native import llama_cpp
from localkv.model.partial_state import read_state_ext, snapshot_interval, window_of
from localkv.model.session import ModelSession, SessionConfig
from localkv.runtime import Runtime

KINDS = {"llama": "kv", "gemma3": "swa", "nemotron_h": "hybrid"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("geometry")
    return {g.name: build(g, where / f"{g.name}.gguf", default_model_path) for g in GEOMETRIES}


def _row_bytes(layers: tuple[object, ...]) -> list[int]:
    return [x.k_row_bytes + x.v_row_bytes for x in layers]  # type: ignore[attr-defined]


@pytest.mark.parametrize("g", GEOMETRIES, ids=[g.name for g in GEOMETRIES])
def test_each_geometry_loads_with_the_real_model_s_cache_shape(
    g: Geometry, models: dict[str, Path]
) -> None:
    with ModelSession(SessionConfig(model_path=models[g.name], n_ctx=512, n_threads=1)) as s:
        assert llama_cpp.llama_model_n_layer(s.model) == g.n_layer
        assert s.memory_kind == KINDS[g.arch]
        assert llama_cpp.llama_model_n_swa(s.model) == g.window
        s.prefill(s.tokenize("Alice was beginning to get very tired of sitting by her sister."))
        attention = _row_bytes(s.capture().layers)
        if g.window:
            sliding = _row_bytes(window_of(s.capture_array()).layers)
            assert (len(attention), len(sliding)) == (g.count("full"), g.count("swa"))
            attention += sliding
        assert len(attention) == g.count("full") + g.count("swa")
        assert set(attention) == {2 * g.n_head_kv * g.head_dim * 2}  # f16 K and V rows
        assert sum(attention) == g.kv_bytes_per_token
        recurrent = read_state_ext(s.ctx, PARTIAL_ONLY).nbytes if g.ssm else 0
        assert g.recurrent_bytes <= recurrent <= g.recurrent_bytes + 64 * g.n_layer


def test_the_real_models_figures() -> None:
    assert by_name("gemma-3-12b").kv_bytes_per_token == 384 << 10  # 48 layers x 8 KiB
    assert by_name("llama-3.1-8b").kv_bytes_per_token == 128 << 10
    granite = by_name("granite-4.0-h-tiny")
    assert granite.kv_bytes_per_token == 8 << 10  # 4 attention layers x 2 KiB
    assert granite.recurrent_bytes == 36 * (3 * (3072 + 256) + 128 * 3072) * 4
    with pytest.raises(ValueError, match="unknown geometry"):
        by_name("gpt-5")


def test_at_gemma_3_12b_geometry_every_row_is_stored_once_and_read_once(
    models: dict[str, Path], tmp_path: Path
) -> None:
    g = by_name("gemma-3-12b")
    f = measure(models[g.name], g, 600, 1, tmp_path)
    assert f.verified and f.reused == f.tokens == f.kept
    assert f.rows_once == f.tokens * (384 << 10)
    assert f.disk <= 1.1 * f.rows_once  # every file the store holds
    assert f.written <= 1.1 * f.rows_once  # write_bytes of the prefill and its saves
    assert f.needed >= f.tokens * (384 << 10)  # below the window, every row is needed
    assert f.restore_read <= 1.1 * f.needed  # rchar of the restore
    assert f.llama_state_file >= f.rows_once


def test_the_script_writes_its_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert (
        main(["--sizes", "200", "--repeats", "1", "--models", "llama-3.1-8b", "--out", str(out)])
        == 0
    )
    doc = json.loads((out / "geometry.json").read_text())
    (row,) = doc["results"]
    assert row["model"] == "llama-3.1-8b" and row["figures"]["verified"] is True
    assert row["derived"]["disk_over_rows_once"] <= 1.1
    assert len(row["load_before"]) == 3
    table = (out / "geometry.md").read_text()
    assert "| Llama 3.1 8B |" in table and "load average" in table


@pytest.mark.parametrize(
    "args",
    [["--sizes", "x"], ["--sizes", "10"], ["--repeats", "0"], ["--models", "gpt-5"], []],
)
def test_bad_arguments_are_usage_errors(args: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*args, *(["--out", str(tmp_path)] if args else [])])
    assert exc.value.code == 2


def test_at_a_hybrid_s_geometry_states_are_kept_where_they_cost_no_more_than_rows(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Granite 4.0-H-Tiny: a 58 MB state against 8 KiB of attention rows per token."""
    g = by_name("granite-4.0-h-tiny")
    config = SessionConfig(model_path=models[g.name], n_ctx=2048, n_threads=1)
    with Runtime(config, cache_dir=tmp_path / "cache") as rt:
        assert rt.cache is not None
        every = snapshot_interval(g.recurrent_bytes, g.kv_bytes_per_token, 256)
        assert rt.session.snapshot_interval == every == 7 * 256
    f = measure(models[g.name], g, 1200, 1, tmp_path)
    assert f.verified and f.reused == f.tokens == f.kept
    # no state on the block grid below the interval: the segment ends' alone (at
    # most the prompt's two); a state at every block would be five more
    assert f.disk <= g.rows_once(f.tokens) + g.recurrent_bytes + (1 << 20)
