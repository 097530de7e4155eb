"""The ``localkv bench`` results as text: each figure's text, and the labelled rows.

The ``fmt_*`` functions turn one figure into text; ``CELLS`` names every figure
and says how to print it, in order. The terminal table (``rich_table``) and the
markdown page (``report.markdown``) show exactly these rows, so both show the
same text for the same number.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.table import Table

from localkv.bench.codecs import EncodingResult
from localkv.bench.encodings import ENCODINGS
from localkv.bench.results import COLUMNS, RESTORE, STEPS, BenchResult, SizeResult
from localkv.bench.stats import ColdStat, Stat

__all__ = [
    "CELLS",
    "NOT_DROPPED",
    "NOT_VERIFIED_COLD",
    "Cell",
    "Row",
    "fmt_bytes",
    "fmt_cold",
    "fmt_encoding",
    "fmt_encoding_cold",
    "fmt_ratio",
    "fmt_read",
    "fmt_s",
    "fmt_stat",
    "lookup_line",
    "rich_table",
    "rows",
]

# ------------------------------------------------------------------ figures
_TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))


def _unit(seconds: float) -> tuple[float, str]:
    for scale, name in _TIME_UNITS:
        if seconds >= scale:
            return scale, name
    return _TIME_UNITS[-1]


def fmt_s(seconds: float) -> str:
    scale, name = _unit(seconds)
    return f"{seconds / scale:.3g} {name}"


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def fmt_stat(stat: Stat) -> str:
    """``median (min-max)`` in the median's unit; just the median for one measurement."""
    if stat.n == 1:
        return fmt_s(stat.median)
    scale, name = _unit(stat.median)
    return f"{_num(stat.median / scale)} {name} ({_num(stat.min / scale)}-{_num(stat.max / scale)})"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_ratio(x: float) -> str:
    return f"{x:.3g}x"


def fmt_encoding(e: EncodingResult) -> str:
    """``ratio | decode median (min-max)``; no time for a decoder that was not verified."""
    decode = fmt_stat(e.decode) if e.verified and e.decode is not None else "NOT VERIFIED"
    return f"{e.ratio:.3f} | {decode}"


NOT_DROPPED = "page cache not dropped"
NOT_VERIFIED_COLD = "page cache drop not verified"


def fmt_cold(c: ColdStat) -> str:
    """The time from storage, or why there is none: never a page-cache time as a cold one."""
    if c.dropped:
        return fmt_stat(c.time)
    if c.evicted and c.read_bytes is None:  # advice given, no /proc/self/io to check it
        return NOT_VERIFIED_COLD
    return NOT_DROPPED


def fmt_read(c: ColdStat) -> str:
    """Median bytes a run read from storage (``?`` where unknown)."""
    return "?" if c.read_bytes is None else fmt_bytes(c.read_bytes.median)


def fmt_encoding_cold(e: EncodingResult) -> str:
    """``decode from disk | read from storage``; no time unless verified and really cold."""
    c = e.decode_cold
    if not e.verified or c is None:
        return "NOT VERIFIED"
    return f"{fmt_cold(c)} | {fmt_read(c)}"


# --------------------------------------------------------------------- rows
Row = tuple[str, list[str]]
Cell = Callable[[SizeResult], str]


def _step(name: str) -> Cell:
    return lambda s: fmt_stat(s.warm_steps[name])


def _compact_step(name: str) -> Cell:
    return lambda s: fmt_stat(s.compact_steps[name])


NOT_PACKED = "not packed"  # a packed-state cell for memory that is not plain KV


def _ratio(name: str) -> Cell:
    return lambda s: fmt_ratio(s.ratios[name]) if name in s.ratios else NOT_PACKED


def _packed_step(name: str) -> Cell:
    return lambda s: fmt_stat(s.packed_steps[name]) if s.packed_steps else NOT_PACKED


def _paired(s: SizeResult, compact: bool = False, packed: bool = False) -> str:
    r = s.compact_over_load_file if compact else s.warm_over_load_file
    if packed:
        if s.packed_over_load_file is None:
            return NOT_PACKED
        r = s.packed_over_load_file
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


def _per_block(s: SizeResult) -> str:
    """A block's bytes without and with the partial state (SWA window, recurrent state)."""
    attention = (s.stored_bytes - s.partial_bytes) / s.blocks
    if not s.partial_bytes:
        return fmt_bytes(attention)
    return f"{fmt_bytes(attention)} + {fmt_bytes(s.partial_bytes / s.blocks)} partial"


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
    ("    of read: V into llama.cpp's columns (reader threads, summed)", _step(COLUMNS)),
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
    ("floor: block files read + xxh3-128", lambda s: fmt_stat(s.floor.read_hash)),
    (
        "floor: the same, each file into its own place",
        lambda s: fmt_stat(s.floor.read_hash_placed),
    ),
    ("llama_state_seq_get_data", lambda s: fmt_stat(s.get_data_s)),
    ("llama_state_seq_set_data", lambda s: fmt_stat(s.floor.set_only)),
    ("cold / warm", _ratio("cold_over_warm")),
    ("warm / llama.cpp-file TTFT", _ratio("warm_over_llama_file_ttft")),
    ("warm / llama.cpp-file TTFT, not in page cache", _cold_ratio),
    ("warm / floor", _ratio("warm_over_floor")),
    ("restore without the probe / llama.cpp load_file", _ratio("restore_over_load_file")),
    ("  the same, each run / the load_file just before it", _paired),
    ("restore without the probe / floor", _ratio("restore_over_floor")),
    ("restore without the probe / read + hash floor", _ratio("restore_over_read_hash")),
    (
        "restore without the probe / (placed read + hash, then set_data)",
        _ratio("restore_over_placed_set"),
    ),
    ("bytes on disk", lambda s: fmt_bytes(s.stored_bytes)),
    ("  per token", lambda s: fmt_bytes(s.stored_bytes / s.tokens)),
    ("  per block / snapshot", _per_block),
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
    ("packed state: warm TTFT", lambda s: fmt_stat(s.packed_ttft) if s.packed_ttft else NOT_PACKED),
    *[(f"  packed: {k}", _packed_step(k)) for k in ("read", "load", "probe")],
    ("  packed: restore without the probe", _packed_step(RESTORE)),
    (
        "  packed restore without the probe / llama.cpp load_file",
        _ratio("packed_restore_over_load_file"),
    ),
    ("  packed: each run / the load_file just before it", lambda s: _paired(s, packed=True)),
    (
        "  packed restore without the probe / read + hash floor",
        _ratio("packed_restore_over_read_hash"),
    ),
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
