"""A cache made on the CPU is not restored on a device, nor the reverse, nor across splits.

Where a model's layers compute decides its bits: the device's kernels, and where
the split between the CPU and the device falls. The identity names the backend
(the devices, by name and description) and the split, so each of these misses,
and the miss says where the snapshot was made and the option that finds it.
The CPU build runs in a subprocess of its own (``cpu_build_env``); the GPU build
is the one ``make gpu`` names. Each side's answer is its own uncached answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.gpu import GPU_SET, cpu_build_env, gpu_build_env
from support.processes import run_localkv
from support.tinymodels import TinyModels

from localkv.model.devices import Device
from localkv.model.ggufmeta import read_gguf_metadata

pytestmark = GPU_SET

WAIT_S = 600  # liveness only: lavapipe is slow
QUESTION = "What is this?"


@pytest.fixture()
def home(tmp_path: Path, tiny_models: TinyModels) -> dict[str, str]:
    """The settings both builds share: the tiny model and one cache."""
    return {
        "LOCALKV_MODEL": str(tiny_models.base),
        "LOCALKV_HOME": str(tmp_path / "cache"),
        "LOCALKV_OTHER_TASKS": "0",
        "COLUMNS": "200",
    }


@pytest.fixture()
def doc(tmp_path: Path, long_text: str) -> Path:
    path = tmp_path / "doc.txt"
    path.write_text(long_text[:3000], encoding="utf-8")
    return path


def _run(env: dict[str, str], *args: str) -> str:
    done = run_localkv(env, *args, "--threads", "1", timeout_s=WAIT_S)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _ask(env: dict[str, str], doc: Path, *args: str) -> dict[str, object]:
    out = _run(env, "ask", "--max-tokens", "6", "--json", *args, str(doc), QUESTION)
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _miss(answer: dict[str, object]) -> str:
    cache = answer["cache"]
    tokens = answer["tokens"]
    assert isinstance(cache, dict) and isinstance(tokens, dict)
    assert tokens["reused"] == 0, answer
    return str(cache["miss_reason"])


def _layers(tiny_models: TinyModels) -> int:
    """Layers llama.cpp counts for the tiny model: its blocks and the output layer."""
    values = read_gguf_metadata(tiny_models.base).values
    return int(values["llama.block_count"]) + 1  # type: ignore[call-overload]


def test_a_cache_made_on_the_cpu_is_not_restored_on_the_device(
    home: dict[str, str], doc: Path
) -> None:
    cpu, gpu = cpu_build_env(**home), gpu_build_env(**home)
    _run(cpu, "prefill", str(doc))
    answer = _ask(gpu, doc)
    reason = _miss(answer)
    assert reason.startswith('not cached with this model or settings; snapshot "doc.txt" '), reason
    assert (
        "was made on the CPU with --flash-attn off, --n-gpu-layers 0 (identity differs:" in reason
    )
    assert "backend" in reason and "offload" in reason, reason
    assert answer["answer"] == _ask(gpu, doc, "--no-cache")["answer"]


def test_a_cache_made_on_the_device_is_not_restored_on_the_cpu(
    home: dict[str, str], doc: Path, device: Device, tiny_models: TinyModels
) -> None:
    cpu, gpu = cpu_build_env(**home), gpu_build_env(**home)
    _run(gpu, "prefill", str(doc))
    answer = _ask(cpu, doc)
    reason = _miss(answer)
    layers = _layers(tiny_models)
    assert f"was made on {device.label()} with " in reason, reason
    assert f"--n-gpu-layers {layers} (identity differs: " in reason, reason
    assert "backend" in reason and "offload" in reason, reason
    assert answer["answer"] == _ask(cpu, doc, "--no-cache")["answer"]


def test_a_cache_made_with_every_layer_on_the_device_is_not_restored_with_a_split(
    home: dict[str, str], doc: Path, device: Device, tiny_models: TinyModels
) -> None:
    gpu = gpu_build_env(**home)
    _run(gpu, "prefill", str(doc))
    split = ["--n-gpu-layers", "1"]
    reason = _miss(_ask(gpu, doc, *split))
    layers = _layers(tiny_models)
    assert f"was made on {device.label()} with --n-gpu-layers {layers} " in reason, reason
    assert "(identity differs: offload)" in reason, reason
    # the split's own cache is restored, and its answer is its uncached one
    _run(gpu, "prefill", *split, str(doc))
    cached = _ask(gpu, doc, *split)
    tokens = cached["tokens"]
    assert isinstance(tokens, dict) and int(tokens["reused"]) > 0, cached
    assert cached["answer"] == _ask(gpu, doc, *split, "--no-cache")["answer"]


def test_no_layer_on_the_device_computes_as_the_cpu_build_does(
    home: dict[str, str], doc: Path
) -> None:
    """``--n-gpu-layers 0`` on a GPU build keeps every operation on the CPU (llama.cpp's
    ``op_offload`` off), so its identity and its bits are the CPU build's."""
    cpu, gpu = cpu_build_env(**home), gpu_build_env(**home)
    none = ["--n-gpu-layers", "0"]
    _run(cpu, "prefill", str(doc))
    cached = _ask(gpu, doc, *none)
    tokens = cached["tokens"]
    assert isinstance(tokens, dict) and int(tokens["reused"]) > 0, cached
    assert cached["answer"] == _ask(gpu, doc, *none, "--no-cache")["answer"]
    assert cached["answer"] == _ask(cpu, doc, "--no-cache")["answer"]
