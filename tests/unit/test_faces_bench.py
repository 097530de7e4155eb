"""The faces bench's load and floors: the load runs where it says, and the floors time real work."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import faces


def _children(pid: int) -> list[int]:
    """``pid`` and the processes it forked, found in /proc (they are its process group)."""
    deadline = time.monotonic() + 10
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.getpgid(int(entry.name)) == pid:
                        found.append(int(entry.name))
                except ProcessLookupError:
                    continue
        if len(found) >= 2 or time.monotonic() > deadline:
            return found


@pytest.mark.parametrize("own", [False, True])
def test_the_load_runs_in_the_session_it_names_and_stops_whole(own: bool) -> None:
    proc = faces._spin(2, own_session=own)
    assert proc is not None
    try:
        pids = _children(proc.pid)
        assert len(pids) == 2
        sessions = {os.getsid(p) for p in pids}
        assert len(sessions) == 1  # both spinners share one session: one program's threads
        if own:
            assert sessions == {proc.pid}  # a new one, which the first leads
        else:
            assert sessions == {os.getsid(0)}  # the bench's own
    finally:
        faces._stop_spin(proc)
    deadline = time.monotonic() + 10
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _running(p)]


def _running(pid: int) -> bool:
    """Neither gone nor a zombie (the first's child may wait for a reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_no_load_starts_nothing() -> None:
    assert faces._spin(0, own_session=True) is None
    faces._stop_spin(None)


def test_a_floor_times_its_work_in_every_process() -> None:
    one = faces.floor(200_000, 1)
    more = faces.floor(2_000_000, 1)
    assert 0 < one < more  # ten times the work takes longer: the children ran it
    assert faces.floor(200_000, 2) > 0


def test_the_page_shows_the_floors_and_where_the_load_ran() -> None:
    run = {"s": 0.2, "load1": 1.0}
    phase = {face: {"localkv": [run]} for face in faces.FACES}
    phase |= {face: {"machine": [run]} for face in faces.FLOORS}
    busy = {face: {who: [{"s": 0.3, "load1": 3.0}] for who in v} for face, v in phase.items()}
    data = {
        "label": "x",
        "tokens": 2000,
        "when": "now",
        "command": "c",
        "runs": 1,
        "ctx": 2560,
        "cpus": 2,
        "load": 2,
        "load_group": "own",
        "autogroup": "1",
        "phases": {"0": phase, "2": busy},
    }
    page = faces.render([data])
    assert "| floor-1 | machine | 200 ms | 300 ms | 1.50x |" in page
    assert "| floor-all | machine |" in page
    assert "in a session of their own (the kernel's session autogroup: 1)" in page
    older = {k: v for k, v in data.items() if k not in ("load_group", "autogroup")}
    older["phases"] = {
        k: {f: v for f, v in p.items() if f not in faces.FLOORS} for k, p in data["phases"].items()
    }
    page = faces.render([older])  # a run from before the floors still renders
    assert "floor-1" not in page.split("```")[-1] and "session" not in page.split("```")[-1]
