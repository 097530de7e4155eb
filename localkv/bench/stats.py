"""How ``localkv bench`` measures one step: wall time, time from storage, peak memory.

- ``Stat``: median, min and max of repeated measurements;
- ``ColdStat``: runs timed with their files dropped from the page cache first
  (``disk.cold_call``), with the bytes each read from storage;
- ``timed``: wall seconds of one call;
- ``peak_memory``: the resident set size high-water mark during one call.
"""

from __future__ import annotations

import platform
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localkv.bench.disk import ColdRun

__all__ = ["ColdStat", "PeakMemory", "Stat", "peak_memory", "timed"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Stat:
    """Median, min and max of repeated measurements (seconds unless named otherwise)."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        if not values:
            raise ValueError("no measurements")
        return cls(
            median=statistics.median(values), min=min(values), max=max(values), n=len(values)
        )

    def as_json(self) -> dict[str, float | int]:
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n}


@dataclass(frozen=True, slots=True, kw_only=True)
class ColdStat:
    """Runs timed with their files evicted from the page cache before each (``disk``).

    The times count as reads from storage only when ``dropped``: the eviction was
    given for every file before every run and every run read at least half the
    bytes it needs of them from storage (``/proc/self/io`` ``read_bytes``).
    Otherwise some or all of the bytes came from the page cache and the times
    are not cold.
    """

    time: Stat
    read_bytes: Stat | None  # bytes read from storage per run; None: /proc/self/io unreadable
    file_bytes: int  # bytes in the files evicted before each run
    evicted: bool  # posix_fadvise(POSIX_FADV_DONTNEED) given for every file before every run
    needed_bytes: int | None = None  # of ``file_bytes``, those a run reads (None: all)

    @classmethod
    def of(
        cls,
        runs: Sequence[ColdRun[float]],
        file_bytes: int,
        needed_bytes: int | None = None,
    ) -> ColdStat:
        """From each run's seconds, bytes read from storage and eviction."""
        reads = [r.read_bytes for r in runs]
        known = [r for r in reads if r is not None]
        return cls(
            time=Stat.of([r.value for r in runs]),
            read_bytes=Stat.of(known) if known and len(known) == len(reads) else None,
            file_bytes=file_bytes,
            evicted=bool(runs) and all(r.evicted for r in runs),
            needed_bytes=needed_bytes,
        )

    @property
    def dropped(self) -> bool:
        """Every run read at least half the bytes it needs from storage: the times are cold."""
        needed = self.file_bytes if self.needed_bytes is None else self.needed_bytes
        return self.evicted and self.read_bytes is not None and self.read_bytes.min >= needed / 2

    @property
    def why_not_cold(self) -> str | None:
        """None when ``dropped``; else why the times are not from storage."""
        if self.dropped:
            return None
        if not self.evicted:
            return "eviction unavailable (no posix_fadvise, or it was refused)"
        if self.read_bytes is None:
            return "reads from storage unknown (no /proc/self/io)"
        return (
            f"a run read {self.read_bytes.min:.0f} of {self.file_bytes} bytes from storage: "
            "the page cache was not dropped"
        )

    def as_json(self) -> dict[str, object]:
        return {
            "seconds": self.time.as_json(),
            "read_bytes": None if self.read_bytes is None else self.read_bytes.as_json(),
            "file_bytes": self.file_bytes,
            "needed_bytes": self.needed_bytes,
            "evicted": self.evicted,
            "page_cache_dropped": self.dropped,
            "why_not_cold": self.why_not_cold,
        }


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------- peak memory
@dataclass(frozen=True, slots=True)
class PeakMemory:
    method: str
    before_bytes: int  # resident set size before the step
    peak_bytes: int  # highest resident set size during the step

    @property
    def delta_bytes(self) -> int:
        return max(0, self.peak_bytes - self.before_bytes)


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_memory(fn: Callable[[], object]) -> PeakMemory:
    """Peak RSS while ``fn`` runs: VmHWM reset through ``/proc/self/clear_refs``
    where the kernel allows it, else ``ru_maxrss`` (a lifetime peak: its delta is
    zero unless the step sets a new high)."""
    before = _status_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")
        reset = before is not None and _status_kib("VmHWM") is not None
    except OSError:
        reset = False
    if reset and before is not None:
        fn()
        peak = _status_kib("VmHWM") or 0
        return PeakMemory("VmHWM after clear_refs 5", before * 1024, peak * 1024)
    scale = 1 if platform.system() == "Darwin" else 1024
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    fn()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return PeakMemory("ru_maxrss (lifetime peak)", start, peak)
