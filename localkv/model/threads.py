"""How many threads llama.cpp runs and how OpenMP waits, from the work running on the machine.

OpenMP's wait at llama.cpp's barriers is read once, when llama.cpp loads (its
libgomp starts). Spinning threads (libgomp's default) decode fastest on idle
cores; on cores other processes use, every barrier of every decode waits for a
spinning thread's time slice. So with other work running on at least half the
cores the wait is passive; otherwise a short spin (``GOMP_SPINCOUNT``
``IDLE_SPINCOUNT``: as fast as libgomp's default on idle cores, and in a
long-lived process it gives the core up soon when other work arrives).
``benchmarks/firsttoken.py`` compares the settings idle and busy.

The work running is ``/proc/loadavg``'s count of runnable tasks, less this
process's own running threads, sampled when the command line starts
(``note_start``) and again just before llama.cpp loads: the 1-minute average
lags a load by a minute and counts the user's own earlier commands, and a single
moment can catch a process that is just ending. ``LOCALKV_OTHER_TASKS`` (a
number) stands for the samples: tests and benchmarks give the load they mean.

A context's threads (``context_threads``): the ``--threads`` the user gave,
else one per core, at most ``MAX_THREADS``. The count its decodes use
(``ThreadFit``): on cores other processes use, each of
llama.cpp's threads gets a share of a core, and every barrier of a decode
(several per layer) waits for the slowest to be scheduled again. So a decode
uses one thread per core the other work leaves free, at least one, and every
core when they are idle; ``benchmarks/ask_ab.py --face api`` compares the first
token with one thread per core against the fitted count beside CPU-bound
processes. The count follows the machine: before a decode, once the last look
is older than ``RECHECK_S``, the runnable tasks are sampled again (a few reads
of ``/proc``). It changes only where it cannot change a result: with flash
attention off on a CPU, where llama.cpp computes the same bits at every thread
count (tested), so the count is no part of the cache identity. A ``--threads``
the user gave, flash attention ``on`` or left to llama.cpp, or a GPU keep the
count the context was made with.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable

__all__ = [
    "ENV_OTHER_TASKS",
    "IDLE_SPINCOUNT",
    "MAX_THREADS",
    "RECHECK_S",
    "ThreadFit",
    "context_threads",
    "fitting_threads",
    "latest_others",
    "note_start",
    "runnable_others",
    "wait_settings",
]

log = logging.getLogger(__name__)

IDLE_SPINCOUNT = "3000"
ENV_OTHER_TASKS = "LOCALKV_OTHER_TASKS"  # the runnable tasks to assume, instead of sampling
# llama.cpp's GGML_MAX_N_THREADS (ggml.h): its CPU thread pool holds no more; past
# it, a pool hangs or crashes the process (tests/reliability: `--threads` 5000, 100000)
MAX_THREADS = 512
_SAMPLES = 3
_started: list[int] = []  # samples taken when the command line started
_latest: list[tuple[float, float]] = []  # (time.monotonic(), runnable_others()) last seen


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
    """Sample the machine as a command starts, before its imports (nothing if it cannot be read).

    ``import localkv`` does not call it: a program using the API is sampled when
    llama.cpp loads, which is when the OpenMP wait is chosen.
    """
    if _given_others() is not None:
        return
    with contextlib.suppress(OSError, ValueError, IndexError):
        _started.extend(_sample(_SAMPLES, 0.001))


def _given_others() -> float | None:
    """``$LOCALKV_OTHER_TASKS`` as a count of tasks, or None where it is unset or not one."""
    value = os.environ.get(ENV_OTHER_TASKS, "").strip()
    if not value:
        return None
    try:
        others = float(value)
    except ValueError:
        others = -1.0
    if not 0 <= others < float("inf"):
        log.warning("%s=%r is not a count of tasks: the machine is sampled", ENV_OTHER_TASKS, value)
        return None
    return others


def runnable_others(
    samples: int = _SAMPLES, gap_s: float = 0.001, *, with_start: bool = True
) -> float | None:
    """Tasks runnable besides this process's: the median of new samples (and the start's).

    ``$LOCALKV_OTHER_TASKS`` where it is set; None where ``/proc`` cannot be read.
    """
    given = _given_others()
    if given is not None:
        _latest[:] = [(time.monotonic(), given)]
        return given
    try:
        counts = [*(_started if with_start else ()), *_sample(samples, gap_s)]
    except (OSError, ValueError, IndexError):
        return None
    others = _median(counts)
    _latest[:] = [(time.monotonic(), others)]
    return others


def latest_others() -> tuple[float, float] | None:
    """When ``runnable_others`` last looked (``time.monotonic()``) and what it saw."""
    return _latest[0] if _latest else None


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


RECHECK_S = 0.5


def context_threads(asked: int | None) -> int:
    """The threads a context is made with: ``asked`` (``--threads``), else one per core."""
    return asked or min(MAX_THREADS, max(1, os.cpu_count() or 1))


def fitting_threads(cores: int, others: float) -> int:
    """Threads for ``cores`` with ``others`` tasks runnable besides this process: one
    per core they leave, at least one (half a core left, a median's, counts as one)."""
    return max(1, min(cores, int(cores - others + 0.5)))


class ThreadFit:
    """The thread count of one context, fitted before decodes (``check``)."""

    def __init__(self, set_threads: Callable[[int], object], cores: int, adapt: bool) -> None:
        self._set_threads, self.cores, self.adapt = set_threads, cores, adapt
        self.current = cores
        self._checked = float("-inf")
        seen = latest_others()  # the look taken as llama.cpp loaded, if recent
        if adapt and seen is not None and time.monotonic() - seen[0] < RECHECK_S:
            self._set(fitting_threads(cores, seen[1]))
            self._checked = seen[0]

    def check(self) -> None:
        """Fit the count for the next decode, when the last look is old (``current``)."""
        now = time.monotonic()
        if self.adapt and now - self._checked >= RECHECK_S:
            self._checked = now
            others = runnable_others(3, 0.0005, with_start=False)
            if others is not None:
                self._set(fitting_threads(self.cores, others))

    def _set(self, n: int) -> None:
        if n != self.current:
            self._set_threads(n)
            self.current = n
