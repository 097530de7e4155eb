"""The device page: the CPU build's run beside the GPU build's, with the ratios device/CPU.

``markdown(cpu, device, command, notes)`` takes the two runs as ``measure`` wrote
them (JSON) and returns the whole page; every figure on it comes from them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from localkv.bench.stats import Stat
from localkv.bench.table import fmt_bytes, fmt_ratio, fmt_stat

__all__ = ["METHOD", "markdown", "verified"]

Run = Mapping[str, Any]  # one build's run, as ``measure`` wrote it

# (label, the length's figure) for the timed rows
_TIMES: tuple[tuple[str, str], ...] = (
    ("cold: prefill + first token", "cold"),
    ("verified restore (lookup + read + load + probe)", "restore"),
    ("first token after a restore (restore + argmax)", "ttft"),
)
_STEPS = ("lookup", "read", "load", "probe")
_ZERO = {"median": 0.0, "min": 0.0, "max": 0.0, "n": 1}  # a step a restore did not take
_BYTES: tuple[tuple[str, str], ...] = (
    ("bytes read by a restore (`rchar`)", "bytes_read"),
    ("block files of the chain", "stored_bytes"),
    ("llama.cpp's state of the sequence", "state_bytes"),
)


def _stat(d: Mapping[str, Any]) -> Stat:
    return Stat(median=d["median"], min=d["min"], max=d["max"], n=d["n"])


def _figure(length: Mapping[str, Any], *, key: str) -> Stat:
    return _stat(length[key])


def _step(length: Mapping[str, Any], *, step: str) -> Stat:
    return _stat(length["steps"].get(step, _ZERO))


def _ratio(a: float, b: float) -> str:
    return fmt_ratio(a / b) if b else "-"


def _rows(cpu: Run, dev: Run) -> list[list[str]]:
    pairs = list(zip(cpu["lengths"], dev["lengths"], strict=True))
    rows = []

    def timed(label: str, get: Callable[[Mapping[str, Any]], Stat]) -> None:
        row = [label]
        for c, d in pairs:
            sc, sd = get(c), get(d)
            row += [fmt_stat(sc), fmt_stat(sd), _ratio(sd.median, sc.median)]
        rows.append(row)

    for label, key in _TIMES:
        timed(label, functools.partial(_figure, key=key))
    for step in _STEPS:
        timed(f"restore step: {step}", functools.partial(_step, step=step))
    for label, key in _BYTES:
        row = [label]
        for c, d in pairs:
            row += [fmt_bytes(c[key]), fmt_bytes(d[key]), _ratio(d[key], c[key])]
        rows.append(row)
    for label, key in (("verified", "verified"), ("first token = cold's", "first_token_agrees")):
        row = [label]
        for c, d in pairs:
            row += ["yes" if c[key] else "NO", "yes" if d[key] else "NO", ""]
        rows.append(row)
    return rows


def _table(cpu: Run, dev: Run) -> list[str]:
    head = ["figure"]
    for x in cpu["lengths"]:
        n = f"{x['tokens']:,}"
        head += [f"{n}: CPU build", f"{n}: device", f"{n}: device/CPU"]
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *["| " + " | ".join(r) + " |" for r in _rows(cpu, dev)],
    ]


def verified(run: Run) -> bool:
    """Every restore of the run verified and giving the cold prefill's first token."""
    return all(x["verified"] and x["first_token_agrees"] for x in run["lengths"])


def _setting(cpu: Run, dev: Run) -> list[str]:
    m, mo, b = dev["machine"], dev["model"], dev["build"]
    return [
        "## Device, machine and model",
        "",
        f"- device: {', '.join(b['devices']) or 'none'} (the devices llama.cpp offloads to, "
        "`localkv.model.devices.offload_devices()`)",
        f"- GPU build: {b['offload'] or 'nothing offloaded'}; the identity's backend "
        f"`{b['backend']}`; libraries `{b['library']}`",
        f"- CPU build: the package's own libraries; backend `{cpu['build']['backend']}`",
        f"- GPU (nvidia-smi): {m.get('gpu')}",
        f"- CPU: {m.get('cpu')}, {m.get('cores')} cores, "
        f"{fmt_bytes(float(m.get('memory_bytes', 0)))} memory",
        f"- {m.get('os')}, Python {m.get('python')}, llama-cpp-python {m.get('llama_cpp_python')}",
        f"- model: {mo.get('name')} ({mo.get('description')}), "
        f"{fmt_bytes(float(mo.get('file_bytes', 0)))}; KV cache {mo.get('type_k')}/"
        f"{mo.get('type_v')}, n_ctx {mo.get('n_ctx')}, n_batch {mo.get('n_batch')}, "
        f"{mo.get('n_threads')} CPU thread(s), blocks of {mo.get('block_size')} tokens",
        f"- flash attention: CPU build {cpu['model'].get('flash_attn')}, "
        f"GPU build {mo.get('flash_attn')}",
        f"- load average (1 min), before and after: CPU build run {cpu['load_before']} -> "
        f"{cpu['load_after']} ({cpu['seconds']:.0f} s), GPU build run {dev['load_before']} -> "
        f"{dev['load_after']} ({dev['seconds']:.0f} s)",
        f"- repeats: {dev['config']['cold_repeats']} cold prefills and "
        f"{dev['config']['repeats']} restores per length and build; cells are median (min-max)",
        "",
    ]


def _verified_lines(cpu: Run, dev: Run) -> list[str]:
    out = []
    for name, run in (("CPU build", cpu), ("GPU build", dev)):
        for x in run["lengths"]:
            read = x["bytes_read"] / x["stored_bytes"] if x["stored_bytes"] else 0.0
            out.append(
                f"- {name}, {x['tokens']:,} tokens: every restore "
                + (
                    "reused all the tokens and passed its probe"
                    if x["verified"]
                    else "NOT VERIFIED"
                )
                + "; its first token "
                + ("is" if x["first_token_agrees"] else "is NOT")
                + f" the cold prefill's; it read {read:.3f}x the bytes of its "
                + f"{x['blocks']} block file(s)"
            )
    return out


def markdown(cpu: Run, dev: Run, command: str, notes: Sequence[str] = ()) -> str:
    """The whole page (``docs/performance/device.md``) of the two runs."""
    lines = [
        "# Device offload: the CPU build against a GPU build",
        "",
        "<!-- Generated by `python -m localkv.bench.device`; do not edit by hand. -->",
        "",
        f"Generated {dev['started']} by:",
        "",
        "```",
        command,
        "```",
        "",
        *_setting(cpu, dev),
        "## Results",
        "",
        "Each length was measured by one process per build, one after the other, on the "
        "same model, threads and machine; device/CPU is the ratio of the medians "
        "(below 1: the device is faster).",
        "",
        *_table(cpu, dev),
        "",
        "## What was verified",
        "",
        *_verified_lines(cpu, dev),
        *[f"- {n}" for n in notes],
        "",
        "## How each figure is measured",
        "",
        *METHOD,
        "",
    ]
    return "\n".join(lines)


METHOD = [
    "- One process per build (`python -m localkv.bench.device.measure`): the CPU build is "
    "the package's own llama.cpp (`LLAMA_CPP_LIB_PATH` unset), the GPU build is the one "
    "`LLAMA_CPP_LIB_PATH` names. Both load the model with `n_gpu_layers` -1: every layer "
    "and the output layer on the device the GPU build offers; the CPU build has none.",
    "- The prompt is the bench text (`localkv.bench.text`) cut to exactly N tokens.",
    "- **cold**: the sequence emptied, the block-aligned prefill of N tokens "
    "(`ModelSession.prefill`) and the argmax of the last logits.",
    "- The N tokens are then saved as blocks into a fresh store (`PrefixCache.prepare` "
    "and `write`; not timed here, see [benchmarks.md](benchmarks.md)).",
    "- **verified restore**: the sequence emptied, `PrefixCache.restore`: lookup, read "
    "(block files checked against the index and their xxh3-128, rows read into a piece "
    "buffer), load (`llama_state_seq_set_data` a piece at a time: into device memory on "
    "the GPU build) and the probe (the last token decoded alone, its logits compared bit "
    "for bit with the ones stored when the blocks were saved on the same build). "
    "**first token after a restore** adds the argmax. The steps are the restore's own "
    "breakdown; on plain KV memory a restore reads and loads a piece at a time, so "
    "**read** holds the reads, the checks and every piece's `llama_state_seq_set_data` "
    "(with flash attention off, the transposition of V too), and **load** what follows. "
    "Block files are in the page cache (just written).",
    "- **bytes read**: `rchar` of `/proc/self/io` over one restore (every read call of "
    "the process, the index's included), median of the restores; against the chain's "
    "block files and llama.cpp's state of the N tokens (`llama_state_seq_get_size`).",
    "- On a CUDA machine, one command builds the CUDA libraries, runs the gpu set on them "
    "and writes this page for the card as `device-cuda.md`: `make gpu-check` "
    "(`bash benchmarks/gpu_check.sh`; `GPU=vulkan` for a Vulkan build).",
]
