"""The ``localkv bench`` results as labelled rows, one cell per prompt length.

``CELLS`` names every figure and says how to print it, in order; the terminal
table (``rich_table``) and the markdown page show exactly these rows.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.table import Table

from localkv.bench.codecs import EncodingResult
from localkv.bench.encodings import ENCODINGS
from localkv.bench.format import (
    fmt_bytes,
    fmt_cold,
    fmt_encoding,
    fmt_encoding_cold,
    fmt_ratio,
    fmt_read,
    fmt_s,
    fmt_stat,
)
from localkv.bench.results import RESTORE, STEPS, BenchResult, SizeResult

__all__ = ["CELLS", "Cell", "Row", "lookup_line", "rich_table", "rows"]

Row = tuple[str, list[str]]
Cell = Callable[[SizeResult], str]


def _step(name: str) -> Cell:
    return lambda s: fmt_stat(s.warm_steps[name])


def _compact_step(name: str) -> Cell:
    return lambda s: fmt_stat(s.compact_steps[name])


def _ratio(name: str) -> Cell:
    return lambda s: fmt_ratio(s.ratios[name])


def _paired(s: SizeResult, compact: bool = False) -> str:
    r = s.compact_over_load_file if compact else s.warm_over_load_file
    return f"{fmt_ratio(r.median)} ({fmt_ratio(r.min)} to {fmt_ratio(r.max)})"


def _save(s: SizeResult) -> str:
    return f"{fmt_s(s.save_prepare_s)} + {fmt_s(s.save_write_s)}"


def _ask_return(s: SizeResult) -> str:
    return f"{fmt_s(s.ask.return_cache_on.median)} / {fmt_s(s.ask.return_cache_off.median)}"


def _peak(s: SizeResult) -> str:
    m = s.restore_memory
    return f"{fmt_bytes(m.peak_bytes)} (+{fmt_bytes(m.delta_bytes)})"


def _encoding(name: str, fmt: Callable[[EncodingResult], str] = fmt_encoding) -> Cell:
    def cell(s: SizeResult) -> str:
        found = [e for e in s.encodings if e.name == name]
        return fmt(found[0]) if found else "-"

    return cell


def _cold_reads(s: SizeResult) -> str:
    return f"{fmt_read(s.warm_evicted)} / {fmt_read(s.llama_file.ttft_cold)}"


def _cold_ratio(s: SizeResult) -> str:
    ours, theirs = s.warm_evicted, s.llama_file.ttft_cold
    if not (ours.dropped and theirs.dropped):
        return "-"
    return fmt_ratio(ours.time.median / theirs.time.median)


CELLS: list[tuple[str, Cell]] = [
    ("cold TTFT (prefill + first token)", lambda s: fmt_stat(s.cold_ttft)),
    ("warm TTFT (verified restore + first token)", lambda s: fmt_stat(s.warm_ttft)),
    *[(f"  warm: {k}", _step(k)) for k in STEPS],
    ("  warm: restore without the probe (lookup + read + load)", _step(RESTORE)),
    ("warm TTFT, block files not in page cache", lambda s: fmt_cold(s.warm_evicted)),
    ("llama.cpp-file TTFT (load N-1, decode 1)", lambda s: fmt_stat(s.llama_file.ttft)),
    (
        "llama.cpp-file TTFT, file not in page cache",
        lambda s: fmt_cold(s.llama_file.ttft_cold),
    ),
    ("read from storage per cold restore (ours / llama.cpp)", _cold_reads),
    ("llama.cpp save_file", lambda s: fmt_stat(s.llama_file.save)),
    ("llama.cpp load_file", lambda s: fmt_stat(s.llama_file.load)),
    ("LlamaDiskCache set", lambda s: fmt_stat(s.disk_cache.set)),
    ("LlamaDiskCache get + load_state", lambda s: fmt_stat(s.disk_cache.get_load)),
    ("floor (read raw state + set_data)", lambda s: fmt_stat(s.floor.read_set)),
    ("llama_state_seq_get_data", lambda s: fmt_stat(s.get_data_s)),
    ("llama_state_seq_set_data", lambda s: fmt_stat(s.floor.set_only)),
    ("cold / warm", _ratio("cold_over_warm")),
    ("warm / llama.cpp-file TTFT", _ratio("warm_over_llama_file_ttft")),
    ("warm / llama.cpp-file TTFT, not in page cache", _cold_ratio),
    ("warm / floor", _ratio("warm_over_floor")),
    ("restore without the probe / llama.cpp load_file", _ratio("restore_over_load_file")),
    ("  the same, each run / the load_file just before it", _paired),
    ("restore without the probe / floor", _ratio("restore_over_floor")),
    ("bytes on disk", lambda s: fmt_bytes(s.stored_bytes)),
    ("raw KV bytes", lambda s: fmt_bytes(s.raw_bytes)),
    ("  on disk / raw", lambda s: f"{s.ratios['stored_over_raw']:.3f}"),
    ("compact blocks: warm TTFT", lambda s: fmt_stat(s.compact_ttft)),
    *[(f"  compact: {k}", _compact_step(k)) for k in ("read", "load")],
    ("  compact: restore without the probe", _compact_step(RESTORE)),
    (
        "  compact restore without the probe / llama.cpp load_file",
        _ratio("compact_restore_over_load_file"),
    ),
    ("  compact: each run / the load_file just before it", lambda s: _paired(s, compact=True)),
    ("  compact: bytes on disk", lambda s: fmt_bytes(s.compact_bytes)),
    ("  compact: on disk / raw", lambda s: f"{s.ratios['compact_over_raw']:.3f}"),
    *[(f"encoding {e.name}: on disk / raw | decode", _encoding(e.name)) for e in ENCODINGS],
    *[
        (
            f"encoding {e.name}: decode from disk | read from storage",
            _encoding(e.name, fmt_encoding_cold),
        )
        for e in ENCODINGS
    ],
    ("llama.cpp file bytes", lambda s: fmt_bytes(s.llama_file.file_bytes)),
    ("LlamaDiskCache bytes", lambda s: fmt_bytes(s.disk_cache.disk_bytes)),
    ("save: prepare + write", _save),
    ("ask TTFT, cold cache, cache on", lambda s: fmt_stat(s.ask.ttft_cache_on)),
    ("ask TTFT, cold cache, cache off", lambda s: fmt_stat(s.ask.ttft_cache_off)),
    ("ask returns, cache on / off", _ask_return),
    ("ask background block write", lambda s: fmt_stat(s.ask.background_write)),
    ("peak RSS in restore (+ over before)", _peak),
    ("verified", lambda s: "yes" if s.warm_verified else "NO"),
    ("same first token as cold", lambda s: "yes" if s.first_token_agrees else "NO"),
]


def rows(result: BenchResult) -> list[Row]:
    """Labelled rows, one cell per prompt length (medians with min-max)."""
    return [(label, [fn(s) for s in result.sizes]) for label, fn in CELLS]


def rich_table(result: BenchResult) -> Table:
    table = Table(title=f"localkv bench — {result.model.get('name')}", show_lines=False)
    table.add_column("prompt tokens", style="bold", overflow="fold")
    for s in result.sizes:
        table.add_column(f"{s.tokens:,}", justify="right")
    for label, cells in rows(result):
        table.add_row(label, *cells)
    return table


def lookup_line(result: BenchResult) -> str | None:
    lk = result.lookup
    if lk is None:
        return None
    return (
        f"Longest-prefix lookup with {lk.blocks:,} blocks indexed (chains of "
        f"{lk.chain_blocks}), request of {lk.request_tokens:,} tokens: hit "
        f"(reuses {lk.hit_reuse:,}) {fmt_stat(lk.hit)}, miss {fmt_stat(lk.miss)}; "
        f"indexing took {fmt_s(lk.insert_s)} ({fmt_s(lk.insert_s / max(1, lk.blocks))} a block)."
    )
