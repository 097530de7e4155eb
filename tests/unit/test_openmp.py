"""OpenMP's wait is chosen from the work running when llama.cpp loads; a user's own setting wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from localkv.model.threads import ENV_OTHER_TASKS, IDLE_SPINCOUNT, runnable_others, wait_settings

_PROBE = (
    "import json, os; from localkv.model.native import openmp_settings, CHOSEN_MARK\n"
    "print(json.dumps([openmp_settings(), os.environ.get(CHOSEN_MARK)]))"
)
_NAMES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LOCALKV_OPENMP_CHOSEN", ENV_OTHER_TASKS)
CORES = len(os.sched_getaffinity(0))
BUSY = str(max(1, CORES // 2))  # other work on half the cores: passive waits


def _settings(**env: str) -> tuple[dict[str, str | None], str | None]:
    base = {k: v for k, v in os.environ.items() if k not in _NAMES}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**base, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    found, mark = json.loads(done.stdout)
    return found, mark


@pytest.fixture
def hogs() -> Iterator[int]:
    """More CPU-bound processes than half the cores, running throughout."""
    n = max(1, CORES // 2) + 1
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]
    try:
        yield n
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_choice_from_the_work_running() -> None:
    assert wait_settings(0, 2) == ("idle", {"GOMP_SPINCOUNT": IDLE_SPINCOUNT})
    assert wait_settings(0.5, 2) == ("idle", {"GOMP_SPINCOUNT": IDLE_SPINCOUNT})
    assert wait_settings(1, 2) == ("busy", {"OMP_WAIT_POLICY": "passive"})
    assert wait_settings(7, 16) == ("idle", {"GOMP_SPINCOUNT": IDLE_SPINCOUNT})
    assert wait_settings(8, 16) == ("busy", {"OMP_WAIT_POLICY": "passive"})
    assert wait_settings(1, 1)[0] == "busy"


def test_the_work_running_is_counted_now(hogs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_OTHER_TASKS, raising=False)
    others = runnable_others(with_start=False)
    assert others is not None and others >= hogs  # (more where other work runs too)


def test_the_load_given_is_the_load_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for given, seen in [("0", 0.0), ("1.5", 1.5), (" 7 ", 7.0)]:
        monkeypatch.setenv(ENV_OTHER_TASKS, given)
        assert runnable_others() == seen
    for bad in ("many", "-1", "nan", "inf"):
        monkeypatch.setenv(ENV_OTHER_TASKS, bad)
        caplog.clear()
        others = runnable_others(with_start=False)  # the machine's, sampled
        assert others is not None and others >= 0
        assert f"{ENV_OTHER_TASKS}={bad!r} is not a count of tasks" in caplog.text


@pytest.mark.parametrize("name", ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT"])
def test_a_users_own_setting_wins(name: str) -> None:
    value = "active" if name == "OMP_WAIT_POLICY" else "1000"
    found, mark = _settings(**{name: value, ENV_OTHER_TASKS: BUSY})
    assert found["chosen"] == "user" and found[name] == value
    other = ({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} - {name}).pop()
    assert found[other] is None and mark is None  # nothing added beside it


def test_a_busy_machine_gets_passive_waits() -> None:
    found, mark = _settings(**{ENV_OTHER_TASKS: BUSY})
    assert found["chosen"] == "busy"
    assert found["OMP_WAIT_POLICY"] == "passive" and found["GOMP_SPINCOUNT"] is None
    assert mark == "OMP_WAIT_POLICY=passive GOMP_SPINCOUNT="


def test_an_idle_machine_gets_a_short_spin() -> None:
    found, mark = _settings(**{ENV_OTHER_TASKS: "0"})
    assert found["chosen"] == "idle"
    assert found["OMP_WAIT_POLICY"] is None and found["GOMP_SPINCOUNT"] == IDLE_SPINCOUNT
    assert mark == f"OMP_WAIT_POLICY= GOMP_SPINCOUNT={IDLE_SPINCOUNT}"


def test_a_process_localkv_starts_chooses_again() -> None:
    # it inherits what its parent chose on an idle machine, marked as localkv's own
    inherited = {"GOMP_SPINCOUNT": IDLE_SPINCOUNT, ENV_OTHER_TASKS: BUSY}
    mark = f"OMP_WAIT_POLICY= GOMP_SPINCOUNT={IDLE_SPINCOUNT}"
    found, _ = _settings(**inherited, LOCALKV_OPENMP_CHOSEN=mark)
    assert found["chosen"] == "busy" and found["OMP_WAIT_POLICY"] == "passive"
    assert found["GOMP_SPINCOUNT"] is None
    # a mark that does not match what is set: the user changed it, and it wins
    found, _ = _settings(GOMP_SPINCOUNT="50", LOCALKV_OPENMP_CHOSEN=mark, **{ENV_OTHER_TASKS: BUSY})
    assert found["chosen"] == "user" and found["GOMP_SPINCOUNT"] == "50"


def test_this_processes_own_threads_are_not_other_work() -> None:
    # threads hashing without the GIL: running threads of this process, as numpy's
    # BLAS threads are while they spin after starting
    import hashlib
    import threading
    import time

    from localkv.model.threads import _own_running

    stop = threading.Event()
    data = b"x" * (1 << 22)

    def hash_until_stopped() -> None:
        while not stop.is_set():
            hashlib.sha256(data).digest()

    threads = [threading.Thread(target=hash_until_stopped) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        seen = 0
        deadline = time.monotonic() + 5
        while seen < 3 and time.monotonic() < deadline:
            seen = max(seen, _own_running())  # the two, and the thread that looks
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert seen >= 3


def test_the_load_median_is_statistics_median() -> None:
    import random
    import statistics

    from localkv.model.threads import _median

    rng = random.Random(5)
    for n in range(1, 9):
        counts = [rng.randrange(6) for _ in range(n)]
        assert _median(counts) == statistics.median(counts)
