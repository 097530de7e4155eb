"""The work running on the machine, read before llama.cpp loads, and the OpenMP wait it calls for.

OpenMP's wait at llama.cpp's barriers is read once, when llama.cpp loads (its
libgomp starts). Spinning threads (libgomp's default) decode fastest on idle
cores; on cores other processes use, every barrier of every decode waits for a
spinning thread's time slice (docs/FIRSTTOKEN.md). So with other work running on
at least half the cores the wait is passive; otherwise a short spin
(``GOMP_SPINCOUNT`` 3000: as fast as libgomp's default of 300000 idle, measured,
and in a long-lived process it gives the core up soon when other work arrives).

The work running is ``/proc/loadavg``'s count of runnable tasks, less this
process's own running threads, sampled when localkv starts to import
(``note_start``) and again just before llama.cpp loads: the 1-minute average
lags a load by a minute and counts the user's own earlier commands, and a single
moment can catch a process that is just ending.
"""

from __future__ import annotations

import contextlib
import os
import time

__all__ = ["IDLE_SPINCOUNT", "note_start", "runnable_others", "wait_settings"]

IDLE_SPINCOUNT = "3000"
_SAMPLES = 3
_started: list[int] = []  # samples taken when localkv started to import


def _own_running() -> int:
    """This process's threads that are running or runnable (this one at least)."""
    n = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat", encoding="ascii", errors="replace") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue  # the thread has ended
        n += state == "R"
    return max(1, n)


def _sample(n: int, gap_s: float) -> list[int]:
    """``n`` counts of other tasks running (numpy's BLAS threads, this process's own, spin)."""
    counts = []
    for i in range(n):
        with open("/proc/loadavg", encoding="ascii") as f:
            running = int(f.read().split()[3].split("/")[0])
        counts.append(max(0, running - _own_running()))
        if i + 1 < n:
            time.sleep(gap_s)
    return counts


def note_start() -> None:
    """Sample the machine as localkv starts to import (nothing if it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        _started.extend(_sample(_SAMPLES, 0.001))


def runnable_others(
    samples: int = _SAMPLES, gap_s: float = 0.001, *, with_start: bool = True
) -> float | None:
    """Tasks runnable besides this process's: the median of new samples (and the start's).

    None where ``/proc`` cannot be read.
    """
    try:
        counts = [*(_started if with_start else ()), *_sample(samples, gap_s)]
    except (OSError, ValueError, IndexError):
        return None
    return _median(counts)


def _median(counts: list[int]) -> float:
    """The median (of an even count, the mean of the middle two): ``statistics.median``,
    whose import (decimal, fractions) costs a fresh command more than the samples."""
    ordered = sorted(counts)
    mid = len(ordered) // 2
    return float(ordered[mid]) if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def wait_settings(others: float, cpus: int) -> tuple[str, dict[str, str]]:
    """The choice (``busy``/``idle``) and the OpenMP settings for ``others`` runnable tasks."""
    if others >= max(1, cpus // 2):
        return "busy", {"OMP_WAIT_POLICY": "passive"}
    return "idle", {"GOMP_SPINCOUNT": IDLE_SPINCOUNT}
