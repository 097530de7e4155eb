"""``localkv bench`` on the tiny model: every measurement runs, every output is written.

No timing assertions: the machine is shared and noisy. The checks are on the
structure of the results, on what must hold whatever the timings (a verified
restore gives the cold run's first token), and on the files written.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from support.tinymodels import TinyModels, tiny_config

from localkv.bench import disk as benchdisk
from localkv.bench import report as benchreport
from localkv.bench import run as benchrun
from localkv.bench.baselines import ColdStat, Stat
from localkv.bench.run import (
    COLUMNS,
    RESTORE,
    STEPS,
    BenchConfig,
    BenchResult,
    cold_stats,
    prompt_tokens,
    run_bench,
)
from localkv.cli.bench import bench, parse_sizes
from localkv.model.session import ModelSession

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
SIZES = (64, 300)


def eviction_checkable(directory: Path) -> bool:
    """Whether evictions can be checked here: posix_fadvise, /proc/self/io, and files
    on a disk (on tmpfs the page cache is the only copy: nothing to drop)."""
    return (
        benchdisk.EVICTION_AVAILABLE
        and benchdisk.storage_reads() is not None
        and benchdisk.file_system(directory) not in benchdisk.IN_MEMORY_FILE_SYSTEMS
    )


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def result(tiny_models: TinyModels, work_dir: Path) -> BenchResult:
    cfg = BenchConfig(
        model_path=tiny_models.base,
        sizes=SIZES,
        cold_repeats=1,
        repeats=1,
        lookup_blocks=50,
        lookup_repeats=3,
        n_threads=1,
    )
    lines: list[str] = []
    out = run_bench(cfg, lines.append, work_dir=work_dir)
    assert any("cold prefill of 300 tokens" in line for line in lines)
    return out


def _positive(stat: Stat) -> bool:
    return stat.n >= 1 and 0 <= stat.min <= stat.median <= stat.max and math.isfinite(stat.max)


def test_prompt_is_exactly_n_tokens_and_lengths_share_a_prefix(tiny_models: TinyModels) -> None:
    with ModelSession(tiny_config(tiny_models.base)) as session:
        long = prompt_tokens(session, 1500)
        assert len(long) == 1500
        for n in (2, 64, 300):
            assert prompt_tokens(session, n) == long[:n]


def test_every_measurement_of_every_size(result: BenchResult) -> None:
    assert [s.tokens for s in result.sizes] == list(SIZES)
    for s in result.sizes:
        stats = [
            s.cold_ttft,
            s.warm_ttft,
            s.warm_evicted.time,
            *s.warm_steps.values(),
            s.get_data_s,
            s.floor.read_set,
            s.floor.set_only,
            s.floor.read_hash,
            s.floor.read_hash_placed,
            s.llama_file.save,
            s.llama_file.load,
            s.llama_file.ttft,
            s.llama_file.ttft_cold.time,
            s.disk_cache.set,
            s.disk_cache.get_load,
            s.ask.ttft_cache_on,
            s.ask.ttft_cache_off,
            s.ask.background_write,
            s.compact_ttft,
            *s.compact_steps.values(),
            s.packed_ttft,
            *s.packed_steps.values(),
        ]
        assert all(_positive(st) for st in stats)
        assert set(s.compact_steps) == {*STEPS, COLUMNS, RESTORE}
        # the tiny model's f16 K/V: the compact blocks are smaller than the plain ones
        assert 0 < s.compact_bytes < s.stored_bytes
        assert set(s.warm_steps) == {*STEPS, COLUMNS, RESTORE}
        # through the packed state: mapped and checked (read), loaded, probed; no columns
        assert s.packed_steps[COLUMNS].max == 0 and s.packed_steps["read"].min > 0
        assert s.warm_verified and s.first_token_agrees
        assert s.blocks == -(-s.tokens // result.config.block_size)
        assert s.stored_bytes > 0 and 0 < s.raw_bytes < s.llama_file.file_bytes + 1024
        assert s.disk_cache.disk_bytes > s.raw_bytes
        assert abs(s.ask.prompt_tokens - s.tokens) <= 8
        assert s.restore_memory.peak_bytes > 0 and s.restore_memory.method
        assert set(s.ratios) == {
            "cold_over_warm",
            "warm_over_llama_file_ttft",
            "warm_over_floor",
            "restore_over_load_file",
            "restore_over_floor",
            "restore_over_read_hash",
            "restore_over_placed_set",
            "stored_over_raw",
            "compact_restore_over_load_file",
            "compact_over_raw",
            "restore_over_load_file_paired",
            "compact_restore_over_load_file_paired",
            "packed_restore_over_load_file",
            "packed_restore_over_read_hash",
            "packed_restore_over_load_file_paired",
        }
        # run by run: one ratio per warm restore, each over its own load_file
        for paired in (s.warm_over_load_file, s.compact_over_load_file, s.packed_over_load_file):
            assert paired.n == result.config.repeats
            assert 0 < paired.min <= paired.median <= paired.max
        restore = s.warm_steps[RESTORE]
        assert restore.min <= s.warm_ttft.min and restore.median < s.warm_ttft.max
        assert all(math.isfinite(v) and v > 0 for v in s.ratios.values())
        assert [e.name for e in s.encodings] == [
            "raw",
            "zstd-1",
            "hi-plane zstd-1",
            "hi-plane q6",
        ]
        for e in s.encodings:
            assert e.verified and e.decode is not None and _positive(e.decode)
            assert 0 < e.ratio <= 1.0 + 1e-3 and e.encode_s > 0
        assert s.encodings[0].ratio == 1.0
        assert s.warm_evicted.file_bytes >= s.stored_bytes > 0
        assert s.llama_file.ttft_cold.file_bytes > 0
        assert len(cold_stats(s)) == 2 + len(s.encodings)
        for _, cold in cold_stats(s):
            assert cold.time.n == result.config.repeats and _positive(cold.time)
    assert result.machine["cores"] and result.machine["llama_cpp_python"] == "0.3.36"
    assert result.machine["compact_decoder"] == benchrun.compact_decoder()
    assert int(str(result.model["n_ctx"])) >= max(SIZES) + 64  # llama.cpp rounds it up


def test_cold_restores_read_their_files_from_storage(result: BenchResult, work_dir: Path) -> None:
    """Where eviction can work, it did: each cold run fetched at least half its files'
    bytes from storage (a run served by the page cache reads next to nothing)."""
    if not eviction_checkable(work_dir):
        pytest.skip(f"no eviction to check here (file system {benchdisk.file_system(work_dir)})")
    for s in result.sizes:
        for label, cold in cold_stats(s):
            assert cold.evicted, label
            assert cold.read_bytes is not None, label
            assert cold.read_bytes.min >= cold.file_bytes / 2, (label, s.tokens, cold)
            assert cold.dropped and cold.why_not_cold is None
        # the chain's block files, every one of them
        assert s.warm_evicted.read_bytes is not None
        assert s.warm_evicted.read_bytes.min >= s.stored_bytes / 2
    assert any("verified cold" in note for note in result.notes)


def test_evict_drops_a_file_from_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 4096)  # 1 MiB, not fsynced: evict flushes it
    run = benchdisk.cold_call([path], path.read_bytes)
    assert len(run.value) == 1 << 20
    assert run.evicted == benchdisk.EVICTION_AVAILABLE
    if not eviction_checkable(tmp_path):
        pytest.skip("no eviction to check here")
    assert run.read_bytes is not None and run.read_bytes >= (1 << 20) // 2
    again = benchdisk.cold_call([], path.read_bytes).read_bytes  # nothing evicted: page cache
    assert again is not None and again < (1 << 20) // 2


def test_without_posix_fadvise_nothing_is_called_cold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 8192)
    monkeypatch.setattr(benchdisk, "EVICTION_AVAILABLE", False)
    assert benchdisk.evict([path]) is False
    assert benchdisk.cold_call([path], path.read_bytes).evicted is False
    stat = Stat.of([0.001, 0.002])
    cases = [
        ColdStat(
            time=stat, read_bytes=Stat.of([8192, 8192]), file_bytes=8192, evicted=False
        ),  # no eviction
        ColdStat(
            time=stat, read_bytes=Stat.of([0, 8192]), file_bytes=8192, evicted=True
        ),  # one run from the page cache
        ColdStat(time=stat, read_bytes=None, file_bytes=8192, evicted=True),  # no /proc/self/io
    ]
    for cold in cases:
        assert not cold.dropped and cold.why_not_cold
        assert benchreport.fmt_stat(stat) not in benchreport.fmt_cold(cold)
        assert cold.as_json()["page_cache_dropped"] is False
    assert (
        benchreport.fmt_cold(cases[0]) == benchreport.fmt_cold(cases[1]) == "page cache not dropped"
    )
    assert benchreport.fmt_cold(cases[2]) == "page cache drop not verified"
    fine = ColdStat(time=stat, read_bytes=Stat.of([4096, 8192]), file_bytes=8192, evicted=True)
    assert fine.dropped and benchreport.fmt_cold(fine) == benchreport.fmt_stat(stat)
    # a restore that leaves the partial states of all but the last block unread
    partly = ColdStat(
        time=stat,
        read_bytes=Stat.of([4096, 4096]),
        file_bytes=32768,
        evicted=True,
        needed_bytes=8192,
    )
    assert partly.dropped and not dataclasses.replace(partly, needed_bytes=None).dropped


def test_lookup_with_many_blocks_finds_the_stored_chain(result: BenchResult) -> None:
    lookup = result.lookup
    assert lookup is not None
    assert lookup.blocks == 50 and lookup.chain_blocks == 8
    assert lookup.hit_reuse == 8 * result.config.block_size
    assert lookup.request_tokens > lookup.hit_reuse
    assert _positive(lookup.hit) and _positive(lookup.miss)


def test_json_markdown_and_chart_hold_the_figures(result: BenchResult, tmp_path: Path) -> None:
    command = "localkv bench --sizes 64,300"
    path = benchreport.write_json(result, tmp_path / "out" / "results.json", command)
    data = json.loads(path.read_text())
    assert data["command"] == command
    first = data["sizes"][0]
    assert first["tokens"] == 64
    assert first["cold_ttft_s"]["median"] == result.sizes[0].cold_ttft.median
    assert set(first["warm_steps_s"]) == {*STEPS, COLUMNS, RESTORE}
    assert first["llama_disk_cache"]["bytes"] == result.sizes[0].disk_cache.disk_bytes
    paired = first["compact"]["restore_over_load_file_paired"]
    assert paired["median"] == result.sizes[0].compact_over_load_file.median
    assert first["restore_over_load_file_paired"]["n"] == result.config.repeats
    cold = first["warm_ttft_evicted"]
    assert cold["seconds"]["median"] == result.sizes[0].warm_evicted.time.median
    assert cold["file_bytes"] == result.sizes[0].warm_evicted.file_bytes
    assert set(cold) >= {"read_bytes", "evicted", "page_cache_dropped", "why_not_cold"}
    assert first["llama_file"]["ttft_evicted"]["file_bytes"] > 0
    assert first["encodings"][0]["decode_cold"]["file_bytes"] > 0
    assert data["lookup"]["blocks"] == 50
    assert data["config"]["decode_workers"] == result.config.workers
    enc = first["encodings"][1]
    assert enc["name"] == "zstd-1" and enc["verified"] is True
    decode = result.sizes[0].encodings[1].decode
    assert decode is not None and enc["decode_s"]["median"] == decode.median

    page = benchreport.markdown(result, command, "chart.png")
    assert command in page and str(result.machine["cpu"]) in page
    assert f"compact block decoder: {result.machine['compact_decoder']}" in page
    assert "llama-cpp-python 0.3.36" in page and "![" in page
    for s in result.sizes:
        assert benchreport.fmt_stat(s.warm_ttft) in page
        assert benchreport.fmt_bytes(s.stored_bytes) in page
        for e in s.encodings:
            assert benchreport.fmt_encoding(e).replace("|", "\\|") in page
    assert "| encoding hi-plane zstd-1: on disk / raw \\| decode |" in page
    for label in (
        "warm TTFT, block files not in page cache",
        "llama.cpp-file TTFT, file not in page cache",
        "read from storage per cold restore (ours / llama.cpp)",
        "warm / llama.cpp-file TTFT, not in page cache",
        "encoding raw: decode from disk \\| read from storage",
        "encoding zstd-1: decode from disk \\| read from storage",
        "encoding hi-plane zstd-1: decode from disk \\| read from storage",
        "encoding hi-plane q6: decode from disk \\| read from storage",
        "the same, each run / the load_file just before it",
        "compact: each run / the load_file just before it",
    ):
        assert f"| {label} |" in page
    for s in result.sizes:
        assert benchreport.fmt_cold(s.warm_evicted) in page
        for e in s.encodings:
            assert benchreport.fmt_encoding_cold(e).replace("|", "\\|") in page
    assert "posix_fadvise" in page and "/proc/self/io" in page
    assert "dropping it needs root" not in page
    assert page.count("\n| ") == len(benchreport.CELLS) + 1  # header + one row per figure

    table = benchreport.rich_table(result)
    assert table.row_count == len(benchreport.CELLS)

    if not HAVE_MATPLOTLIB:
        pytest.skip("matplotlib is not installed: the chart is not drawn")
    png = tmp_path / "out" / "ttft.png"
    assert benchreport.write_chart(result, png) is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_without_matplotlib_says_so(
    result: BenchResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    why = benchreport.write_chart(result, tmp_path / "ttft.png")
    assert why is not None and "matplotlib" in why
    assert not (tmp_path / "ttft.png").exists()


def test_bench_command_writes_results_and_docs(tiny_models: TinyModels, tmp_path: Path) -> None:
    out = tmp_path / "results"
    docs = tmp_path / "docs" / "performance" / "benchmarks.md"
    args = [
        "--model", str(tiny_models.base), "--sizes", "300,64", "--repeats", "1",
        "--cold-repeats", "1", "--lookup-blocks", "10", "--threads", "1",
        "--flash-attn", "off", "--out", str(out), "--json", "--write-docs", str(docs),
    ]  # fmt: skip
    run = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert run.exit_code == 0, run.output
    data = json.loads(run.stdout)
    assert [s["tokens"] for s in data["sizes"]] == [64, 300]
    assert data["command"].startswith("localkv bench --model ")
    assert "--sizes 300,64" in data["command"]
    # flash attention off as asked: V transposed, and the page says so
    assert data["model"]["flash_attn"] == "off (llama.cpp: off)"
    assert "flash attention off (llama.cpp: off)" in docs.read_text()
    assert json.loads((out / "results.json").read_text())["sizes"][1]["tokens"] == 300
    page = docs.read_text()
    assert data["command"] in page and "## Machine" in page
    assert (out / "ttft.png").exists() == HAVE_MATPLOTLIB
    assert (docs.parent / "benchmarks-ttft.png").exists() == HAVE_MATPLOTLIB
    assert "cold prefill of 64 tokens" in run.stderr


def test_sizes_and_config_are_checked(tiny_models: TinyModels) -> None:
    assert parse_sizes("2048, 512,8192") == (512, 2048, 8192)
    for bad in ("", "a,b", "1,512"):
        with pytest.raises(click.BadParameter):
            parse_sizes(bad)
    for sizes in ((1,), (64, 64), ()):
        with pytest.raises(ValueError):
            BenchConfig(model_path=tiny_models.base, sizes=sizes)
    with pytest.raises(ValueError):
        BenchConfig(model_path=tiny_models.base, repeats=0)
