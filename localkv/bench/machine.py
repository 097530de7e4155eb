"""The machine ``localkv bench`` ran on: CPU, cores, memory, GPU, load and versions."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from localkv.model.native import llama_cpp, llama_cpp_version
from localkv.storage import q6

__all__ = ["cpu_model", "describe_machine", "gpu_description", "load_average", "total_memory"]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    """The 1-minute load average, or ``unknown``."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


def total_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def gpu_description() -> str:
    """GPU names (from ``nvidia-smi`` where present) and whether llama.cpp can offload."""
    build = "GPU offload" if llama_cpp.llama_supports_gpu_offload() else "CPU only"
    names: list[str] = []
    smi = shutil.which("nvidia-smi")
    if smi:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [smi, "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
            names = [line.strip() for line in out.splitlines() if line.strip()]
    return f"{', '.join(names) or 'none'} (llama.cpp build: {build})"


def describe_machine() -> dict[str, object]:
    """Cores, memory, CPU model, GPU (or none) and library versions."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 0,
        "memory_bytes": total_memory(),
        "gpu": gpu_description(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp_version(),
        "gpu_offload_build": bool(llama_cpp.llama_supports_gpu_offload()),
        "compact_decoder": compact_decoder(),
    }


def compact_decoder() -> str:
    """What decodes compact block files here: AVX2, plain C, or numpy (not built)."""
    if q6.simd():
        return "compiled, AVX2"
    return "compiled, no AVX2" if q6.compiled() else "numpy (extension not built)"
