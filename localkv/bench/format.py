"""One ``localkv bench`` figure as text: times, byte counts, ratios, cold runs, encodings.

The table and the markdown page print every cell through these, so both show
the same text for the same number.
"""

from __future__ import annotations

from localkv.bench.codecs import EncodingResult
from localkv.bench.stats import ColdStat, Stat

__all__ = [
    "NOT_DROPPED",
    "NOT_VERIFIED_COLD",
    "fmt_bytes",
    "fmt_cold",
    "fmt_encoding",
    "fmt_encoding_cold",
    "fmt_ratio",
    "fmt_read",
    "fmt_s",
    "fmt_stat",
]

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
