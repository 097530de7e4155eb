"""The gpu set's common parts: its marks, and the CPU build beside the GPU one.

``make gpu`` runs ``pytest -m gpu tests/gpu`` with ``LLAMA_CPP_LIB_PATH`` naming a GPU
build's libraries (``build/gpu/$GPU/lib``): in-process llama.cpp is that build. A
subprocess given ``cpu_build_env()`` loads the CPU build the package installed.
"""

from __future__ import annotations

import os

import pytest

GPU_SET = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "'gpu' not in (config.getoption('markexpr') or '')",
        reason="the gpu set runs with make gpu (a GPU build of llama.cpp)",
    ),
]


def cpu_build_env(**extra: str) -> dict[str, str]:
    """This process's environment for a subprocess on the CPU build."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    env.update(extra)
    return env


def gpu_build_env(**extra: str) -> dict[str, str]:
    """This process's environment (the GPU build's libraries) for a subprocess."""
    env = dict(os.environ)
    env.update(extra)
    return env
