"""The geometry benchmark's synthetic chain: random rows stored and restored as a prefill's.

A chain made without the prefill's attention (``chain.synthetic_prefill``) at
the Llama 3.1 8B geometry is saved through ``Runtime.save_prefix``; a fresh
runtime restores every one of its tokens, verified by the probe, into exactly
the state that was loaded; and the command writes its own section of the page
and key of the JSON, leaving the rest of both as they were.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localkv.bench.geometry.chain import synthetic_prefill
from localkv.bench.geometry.measure import document_for, session_config
from localkv.bench.geometry.models import build
from localkv.bench.geometry.run import main
from localkv.bench.geometry.shapes import by_name
from localkv.bench.geometry.synthetic_page import BEGIN, END
from localkv.runtime import Runtime

N = 600


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    where = tmp_path_factory.mktemp("synthetic")
    return build(by_name("llama-3.1-8b"), where / "llama.gguf", default_model_path)


def test_a_synthetic_chain_restores_verified_whole_and_bit_for_bit(
    llama_8b: Path, tmp_path: Path
) -> None:
    with Runtime(session_config(llama_8b, N), cache_dir=tmp_path) as rt:
        request = rt.build([document_for(rt, N)], system=None)
        ends = rt.schedule(request)
        synthetic_prefill(rt.session, request.tokens, ends)
        assert rt.session.tokens == request.tokens
        assert rt.session.last_logits is not None
        loaded = rt.session.capture_state()
        rt.save_prefix(request.boundaries)
        saved = rt.wait_for_saves()
    n = len(request.tokens)
    assert [(s.blocks, s.end) for s in saved] == [(-(-n // 256), n)]  # every block, to the end
    with Runtime(session_config(llama_8b, N), cache_dir=tmp_path) as rt:
        result, report = rt.restore(request.tokens, ends)
        assert result is not None
        assert (report.reused, report.verified) == (len(request.tokens), True)
        assert {"lookup", "read", "load", "probe"} <= set(result.breakdown)
        assert rt.session.capture_state() == loaded


def test_the_command_writes_its_own_section_and_key(llama_8b: Path, tmp_path: Path) -> None:
    del llama_8b  # the command builds its own
    (tmp_path / "geometry.md").write_text("# page\n\nkept\n")
    (tmp_path / "geometry.json").write_text(json.dumps({"runs": [1]}))
    args = ["--synthetic", "300", "--repeats", "1", "--out", str(tmp_path)]
    for _ in range(2):  # a second run replaces the section
        assert main(args) == 0
    page = (tmp_path / "geometry.md").read_text()
    assert page.startswith("# page\n\nkept\n")
    assert page.count(BEGIN) == page.count(END) == 1
    data = json.loads((tmp_path / "geometry.json").read_text())
    assert data["runs"] == [1]
    (row,) = data["synthetic"]["results"]
    assert row["figures"]["reused"] == row["figures"]["tokens"] > 300
    assert row["figures"]["verified"] is True
    assert row["figures"]["dropped_from_page_cache"] > 0
    # a restore's time is its lookup, read and load: the columns are a part of its read
    first = row["figures"]["first"]
    assert first["restore_s"] == pytest.approx(first["lookup"] + first["read"] + first["load"])
    assert first["with_probe_s"] == pytest.approx(first["restore_s"] + first["probe"])
    # the first restore read the blocks (V into columns); the repeats, the packed state
    assert first["columns"] > 0 and "columns" not in row["figures"]["warm"]
    assert row["figures"]["warm"]["probe"] > 0
    # llama.cpp's own load of the packed stream, from new mappings and a mapped one, on the page
    load = row["figures"]["llama_load"]
    assert load["new_s"] > 0 and load["mapped_s"] > 0 and load["own_pace_digest_s"] > 0
    assert 0 <= load["huge_page_bytes"] <= load["packed_bytes"]
    assert row["derived"]["warm_over_llama_load"] == pytest.approx(
        row["figures"]["warm"]["restore_s"] / load["new_s"]
    )
    assert "llama.cpp's own load of the packed stream" in page


@pytest.mark.parametrize("lengths", ["10", "x", ","])
def test_bad_synthetic_lengths_are_usage_errors(lengths: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--synthetic", lengths, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert not (tmp_path / "geometry.md").exists()
