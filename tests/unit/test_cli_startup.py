"""What the command line does as it starts (``localkv.cli.start_up``), not ``import localkv``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.tinymodels import TinyModels

from localkv.cli import BLAS_THREADS
from localkv.model.threads import ENV_OTHER_TASKS

# the files a process opens and the modules it imports, in order, as Python's audit hooks see them
_WATCH = """
import sys
seen = []
def hook(event, args):
    if event == "open" and args[0] == "/proc/loadavg":
        seen.append("loadavg")
    elif event == "import" and args[0].partition(".")[0] == "llama_cpp" and "llama_cpp" not in seen:
        seen.append("llama_cpp")
sys.addaudithook(hook)
"""


def _watched(code: str, env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _WATCH + code + "\nprint(' '.join(seen))"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1].split()


def _env(**given: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_OTHER_TASKS}
    return {**env, **given}


def test_importing_localkv_reads_no_machine_load() -> None:
    assert _watched("import localkv, localkv.cli", _env()) == []
    # the API samples it just before llama.cpp loads, when the OpenMP wait is chosen
    assert _watched("import localkv\nlocalkv.Runtime", _env())[-1] == "llama_cpp"


@pytest.mark.skipif(not Path("/proc/loadavg").is_file(), reason="reads /proc/loadavg")
def test_a_command_samples_the_load_before_llama_cpp_loads(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("The meeting is on Friday.", encoding="utf-8")
    argv = ["localkv", "ask", "--model", str(tiny_models.base), "--max-tokens", "1"]
    code = f"sys.argv = {[*argv, str(doc), 'When?']!r}\nfrom localkv.cli import main\n"
    code += "try:\n    main()\nexcept SystemExit:\n    pass"
    env = _env(LOCALKV_HOME=str(tmp_path / "home"))
    seen = _watched(code, env)
    assert seen[0] == "loadavg" and "llama_cpp" in seen  # sampled at start-up, then loaded
    # a load given is taken as it is: the machine is not read at all
    assert _watched(code, {**env, ENV_OTHER_TASKS: "0"}) == ["llama_cpp"]


def _threads_after_numpy(call_main: bool, blas: str | None) -> tuple[str, int]:
    """OPENBLAS_NUM_THREADS and the process's threads once numpy is loaded."""
    import os

    env = {k: v for k, v in os.environ.items() if k != BLAS_THREADS}
    env.update({BLAS_THREADS: blas} if blas is not None else {})
    code = "import os, sys\n"
    if call_main:
        code += "sys.argv = ['localkv', '--version']\nfrom localkv.cli import main\n"
        code += "try:\n    main()\nexcept SystemExit:\n    pass\n"
    code += f"import numpy\nprint(os.environ.get({BLAS_THREADS!r}))\n"
    code += "print(len(os.listdir('/proc/self/task')))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    value, threads = done.stdout.splitlines()[-2:]
    return value, int(threads)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_the_command_line_loads_numpy_with_one_blas_thread_unless_the_user_set_it() -> None:
    import os

    value, ours = _threads_after_numpy(True, None)
    assert value == "1"
    assert ours == _threads_after_numpy(False, "1")[1]
    if len(os.sched_getaffinity(0)) > 1:  # OpenBLAS's own default: a thread for each core
        assert _threads_after_numpy(False, None)[1] > ours
    value, theirs = _threads_after_numpy(True, "2")
    assert value == "2" and theirs == _threads_after_numpy(False, "2")[1]
