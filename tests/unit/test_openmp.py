"""OpenMP's wait policy is chosen before llama.cpp loads, and a user's own setting wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = (
    "import json, os; from localkv.model.native import openmp_settings\n"
    "print(json.dumps([openmp_settings(), os.getloadavg()[0], len(os.sched_getaffinity(0))]))"
)


def _settings(**env: str) -> tuple[dict[str, str | None], float, int]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**base, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    found, load, cpus = json.loads(done.stdout)
    return found, load, cpus


@pytest.mark.parametrize("name", ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT"])
def test_a_users_own_setting_wins(name: str) -> None:
    value = "active" if name == "OMP_WAIT_POLICY" else "1000"
    found, _, _ = _settings(**{name: value})
    assert found["chosen"] == "user" and found[name] == value
    other = ({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} - {name}).pop()
    assert found[other] is None  # nothing added beside it


def test_without_one_the_load_when_llama_cpp_loads_decides() -> None:
    found, load, cpus = _settings()
    assert found["chosen"] in ("busy", "idle")
    # the load is read again after the choice: the two may differ only near the threshold
    if abs(load - cpus) > 0.5:
        assert found["chosen"] == ("busy" if load >= cpus else "idle")
    assert found["OMP_WAIT_POLICY"] == ("passive" if found["chosen"] == "busy" else None)
