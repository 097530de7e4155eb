"""The gpu set's common parts: its marks, and the CPU build beside the GPU one.

``make gpu`` runs ``pytest -m gpu tests/gpu`` with ``LLAMA_CPP_LIB_PATH`` naming a GPU
build's libraries (``build/gpu/$GPU/lib``): in-process llama.cpp is that build. A
subprocess given ``cpu_build_env()`` loads the CPU build the package installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from localkv.cache.identity import probe_kv_layout
from localkv.model.session import ModelSession, SessionConfig

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


def state_shape(path: Path, n_tokens: int, text: str, **config: object) -> dict[str, object]:
    """What a session of this process's build captures for ``n_tokens`` of ``text``: the
    raw state's size and digest, the KV layout the codec parsed, and the partial part's.

    A subprocess on the other build runs it with ``python -c`` (``state_shape_command``).
    """
    options: dict[str, object] = {"n_ctx": 1024, "n_threads": 1}
    options.update(config)
    with ModelSession(SessionConfig(model_path=path, **options)) as session:  # type: ignore[arg-type]
        kv, partial_layout = probe_kv_layout(session)
        session.prefill(session.tokenize(text)[:n_tokens])
        raw = session.capture_array()
        parsed = session.capture() if kv is not None else None
        return {
            "bytes": int(raw.shape[0]),
            "sha256": hashlib.sha256(raw.tobytes()).hexdigest(),
            "layout": [list(x) for x in parsed.layout()] if parsed is not None else [],
            "v_trans": parsed.v_trans if parsed is not None else None,
            "rows": parsed.n_tokens if parsed is not None else 0,
            "partial_layout": partial_layout,
        }


def state_shape_command(path: Path, n_tokens: int, text: str, **config: object) -> list[str]:
    """The command that prints ``state_shape``'s JSON (run it with ``cwd`` = tests/)."""
    code = (
        "import json, sys; from pathlib import Path; from support.gpu import state_shape; "
        "print(json.dumps(state_shape(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], "
        "**json.loads(sys.argv[4]))))"
    )
    return [sys.executable, "-c", code, str(path), str(n_tokens), text, json.dumps(config)]
