"""The compute devices a model's layers go to: what llama.cpp's build offers, and the split.

A GPU build of llama.cpp (CUDA, Metal, Vulkan, ...) registers its devices with
ggml; llama.cpp's default selection offloads to every discrete GPU, or, where
there is none, to the integrated ones (``llama_prepare_model_devices``). Which
device computes a layer decides its bits (other kernels, other reductions), and
so does where the split between the CPU and the device falls, so both are part
of the cache identity (``localkv.cache.identity``). llama-cpp-python binds no
device call; they are read from the ``libggml`` that was loaded beside
``libllama`` (``LLAMA_CPP_LIB_PATH`` may name another build's).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

from localkv.model.native import ensure_backend, llama_cpp

__all__ = ["Device", "Offload", "devices", "offload_devices", "offload_of", "offloads"]

# enum ggml_backend_dev_type
_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One device ggml registered: ``Vulkan0``, ``llvmpipe (LLVM 15.0.6, 256 bits)``, igpu."""

    name: str
    description: str
    kind: str

    def label(self) -> str:
        return f"{self.name} ({self.description})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Offload:
    """Where a model's layers compute: the devices, and how many of its layers are on them.

    llama.cpp counts the output layer as one more: ``n_layer + 1`` puts everything
    on the device.
    """

    devices: tuple[Device, ...]
    layers: int
    of: int
    op_offload: bool  # large batches' host-weight operations go to the device too

    @property
    def on_cpu(self) -> bool:
        """Nothing is computed on a device."""
        return not self.devices or (self.layers == 0 and not self.op_offload)

    def backend(self) -> str:
        """The identity's ``backend``: ``cpu``, or the devices by name and description."""
        return "cpu" if self.on_cpu else ", ".join(d.label() for d in self.devices)

    def split(self) -> str:
        """The identity's ``offload``: empty on the CPU, else layers on the device and the rest."""
        if self.on_cpu:
            return ""
        ops = ", host weights' large batches on the device" if self.op_offload else ""
        return f"{self.layers}/{self.of} layers on the device{ops}"


_GGML_NAMES = ("libggml.so", "libggml.dylib", "ggml.dll")
# a GPU build whose ggml could not be read is still not the CPU
_UNKNOWN = Device(name="GPU", description="a device llama.cpp's build offers", kind="gpu")


@functools.cache
def _ggml() -> ctypes.CDLL | None:
    """The ``libggml`` beside the ``libllama`` llama-cpp-python loaded (already in the process)."""
    base = Path(llama_cpp.llama_cpp._base_path)
    found = [base / name for name in _GGML_NAMES if (base / name).is_file()]
    if not found:
        return None
    lib = ctypes.CDLL(str(found[0]))
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_count.argtypes = []
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    return lib


@functools.cache
def devices() -> tuple[Device, ...]:
    """Every device the loaded build registered, the CPU's included."""
    ensure_backend()
    if not llama_cpp.llama_supports_gpu_offload():
        return ()
    lib = _ggml()
    if lib is None:
        return (_UNKNOWN,)
    out = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        out.append(
            Device(
                name=(lib.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
                description=(lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                kind=_TYPES.get(int(lib.ggml_backend_dev_type(dev)), "other"),
            )
        )
    return tuple(out)


def offload_devices() -> tuple[Device, ...]:
    """The devices llama.cpp's default selection offloads to: the GPUs, else the integrated."""
    found = devices()
    gpus = tuple(d for d in found if d.kind == "gpu")
    return gpus or tuple(d for d in found if d.kind == "igpu")


def offloads(n_gpu_layers: int) -> bool:
    """Whether asking for ``n_gpu_layers`` puts any layer on a device of this build."""
    return n_gpu_layers != 0 and bool(offload_devices())


def offload_of(n_gpu_layers: int, n_layer: int, *, op_offload: bool) -> Offload:
    """Where a model of ``n_layer`` layers computes when ``n_gpu_layers`` are asked for
    (-1: all), on this build."""
    found = offload_devices()
    whole = n_layer + 1
    layers = whole if n_gpu_layers < 0 else min(n_gpu_layers, whole)
    return Offload(
        devices=found,
        layers=layers if found else 0,
        of=whole,
        op_offload=op_offload and bool(found),
    )
