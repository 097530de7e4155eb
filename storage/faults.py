"""Fault injection for the crash and I/O-error tests: named points that do nothing by default.

The store calls ``point("before_rename")`` and the like at the places where a
crash or an I/O error matters. Unless ``$LOCALKV_FAULT`` (read at import) or
``arm()`` names that point, ``point`` returns at once: one global lookup.

A spec is a comma-separated list of ``POINT:ACTION[@WHEN]``:

- ``ACTION``: ``kill`` (SIGKILL this process: no cleanup, no flush), ``enospc``
  or ``eio`` (raise ``OSError`` with that errno);
- ``WHEN``: ``N`` fires on the N-th time the point is reached (default 1),
  ``*`` fires every time.

Example: ``LOCALKV_FAULT=before_commit:kill@3,before_fsync:enospc@*``.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["ENV_FAULT", "POINTS", "Fault", "arm", "disarm", "injected", "parse", "point"]

ENV_FAULT = "LOCALKV_FAULT"
POINTS = frozenset(
    {
        "before_write",  # a block's temp file is created, nothing written yet
        "before_fsync",  # the temp file is written, not yet flushed
        "before_rename",  # the temp file is durable, not yet at its final name
        "before_commit",  # an index transaction is about to commit
        "after_commit",  # an index transaction has committed
        "before_unlink",  # rows are gone, their files are about to be removed
        "mid_gc",  # between gc's steps and between the files it removes
    }
)
_ACTIONS = frozenset({"kill", "enospc", "eio"})
_ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO}


@dataclass(frozen=True, slots=True)
class Fault:
    """Do ``action`` at ``point``: on its ``nth`` hit, or on every hit when ``nth`` is None."""

    point: str
    action: str
    nth: int | None = 1


def parse(spec: str) -> list[Fault]:
    """The faults of a ``$LOCALKV_FAULT`` spec (ValueError if malformed)."""
    faults: list[Fault] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, rest = item.partition(":")
        action, _, when = rest.partition("@")
        if name not in POINTS or action not in _ACTIONS:
            raise ValueError(
                f"bad fault {item!r}: POINT:ACTION[@N|@*], points {', '.join(sorted(POINTS))}, "
                f"actions {', '.join(sorted(_ACTIONS))}"
            )
        if when == "*":
            faults.append(Fault(name, action, None))
        elif not when or (when.isdigit() and int(when) > 0):
            faults.append(Fault(name, action, int(when or 1)))
        else:
            raise ValueError(f"bad fault {item!r}: @N (N >= 1) or @*")
    return faults


_lock = threading.Lock()
_armed: dict[str, list[Fault]] = {}
_hits: dict[str, int] = {}


def arm(spec: str | list[Fault]) -> None:
    """Arm faults (replacing any armed before) and reset the hit counts."""
    faults = parse(spec) if isinstance(spec, str) else spec
    with _lock:
        _armed.clear()
        _hits.clear()
        for fault in faults:
            _armed.setdefault(fault.point, []).append(fault)


def disarm() -> None:
    arm([])


@contextmanager
def injected(spec: str) -> Iterator[None]:
    """Arm ``spec`` for the duration of a ``with`` block (tests in this process)."""
    arm(spec)
    try:
        yield
    finally:
        disarm()


def point(name: str) -> None:
    """A fault-injection point: a no-op unless a fault is armed for ``name``."""
    if not _armed:
        return
    with _lock:
        faults = _armed.get(name)
        if not faults:
            return
        hit = _hits[name] = _hits.get(name, 0) + 1
        fire = next((f for f in faults if f.nth is None or f.nth == hit), None)
    if fire is None:
        return
    if fire.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    code = _ERRNO[fire.action]
    raise OSError(code, f"{os.strerror(code)} (injected at {name})")


def _arm_from_environment() -> None:
    """Arm ``$LOCALKV_FAULT``; a malformed spec arms nothing (the CLI refuses it as a
    usage error before any work; ``parse`` says why)."""
    spec = os.environ.get(ENV_FAULT)
    if not spec:
        return
    try:
        arm(spec)
    except ValueError as exc:
        logging.getLogger(__name__).info("%s ignored: %s", ENV_FAULT, exc)


_arm_from_environment()
