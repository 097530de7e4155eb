"""Cache identity: everything that decides whether a stored KV state is reusable.

Three tiers (DESIGN §3), all folded into one digest under the default strict
policy:

- semantic: model content hash, LoRA adapters and scales, effective RoPE/YaRN
  parameters, KV cache types;
- representation: architecture, layer count, per-layer K/V types and row sizes,
  V layout (transposed or not), the KV cells' layout (``kv.section``: with
  llama.cpp's cell extension or not), memory kind, state format version;
- execution: llama-cpp-python version, backend (``cpu``, or the devices layers are
  offloaded to, by name and description), the offload split where there is one,
  effective flash attention, llama.cpp's system description, and the thread count
  when flash attention is on (its numerics depend on it).

``n_ctx``, ``n_batch`` and thread count do not change KV values and are not
part of identity.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from localkv.kv import codec, partial
from localkv.model.memories import memory_refusal
from localkv.model.native import ggml_type_name, llama_cpp, llama_cpp_version, system_info
from localkv.model.partial_state import read_state_ext, snapshot_interval

if TYPE_CHECKING:
    from localkv.model.session import ModelSession
    from localkv.storage.filehash import FileHasher

__all__ = ["IDENTITY_TAG", "STATE_FORMAT", "Identity", "identity_of", "probe_kv_layout"]

IDENTITY_TAG = "lkv-id1"
STATE_FORMAT = "llama.cpp kv-seq state v3 (llama-cpp-python 0.3.36)"

_SEMANTIC = (
    "model_sha256",
    "loras",
    "rope_freq_base",
    "rope_freq_scale",
    "rope_scaling_type",
    "yarn_ext_factor",
    "yarn_attn_factor",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "n_ctx_orig",
    "type_k",
    "type_v",
)
_REPRESENTATION = (
    "architecture",
    "n_layer",
    "kv_layout",
    "v_trans",
    "memory_kind",
    "state_format",
)
_EXECUTION = ("llama_cpp_python", "backend", "flash_attn", "attn_threads", "system_info")
# representation fields of memory that is not a plain KV cache; left out of a plain
# model's digest, so plain caches keep their identity
_MEMORY = ("swa_window", "swa_full", "partial_layout")
# likewise: KV cells with llama.cpp's extension (M-RoPE), named only where they have it
_CELLS = ("cell_ext",)
# and the split of layers between the CPU and a device, named only where one computes
_DEVICE = ("offload",)


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """The effective computation a KV state came from."""

    # semantic
    model_sha256: str
    loras: tuple[tuple[str, float], ...]
    rope_freq_base: float
    rope_freq_scale: float
    rope_scaling_type: str
    yarn_ext_factor: float
    yarn_attn_factor: float
    yarn_beta_fast: float
    yarn_beta_slow: float
    n_ctx_orig: int
    type_k: str
    type_v: str
    # representation
    architecture: str
    n_layer: int
    kv_layout: tuple[tuple[str, int, str, int], ...]
    v_trans: bool
    memory_kind: str
    state_format: str
    # execution
    llama_cpp_python: str
    backend: str
    flash_attn: bool
    attn_threads: int  # flash attention's numerics depend on the thread count; 0 when off
    system_info: str
    # memory kinds (kv.partial): SWA window, swa_full, the partial part's layers and rows
    swa_window: int = 0
    swa_full: bool = False
    partial_layout: str = ""
    cell_ext: bool = False  # KV cells carry x, y and the token (``kv.section``)
    offload: str = ""  # ``devices.Offload.split``: layers on the device; empty on the CPU

    def tiers(self) -> dict[str, dict[str, Any]]:
        """Fields by tier, as plain JSON-able values."""
        values = self.as_dict()
        memory = _MEMORY if self.memory_kind != "kv" else ()
        cells = _CELLS if self.cell_ext else ()
        device = _DEVICE if self.backend != "cpu" else ()
        return {
            "semantic": {k: values[k] for k in _SEMANTIC},
            "representation": {k: values[k] for k in (*_REPRESENTATION, *memory, *cells)},
            "execution": {k: values[k] for k in (*_EXECUTION, *device)},
        }

    def as_dict(self) -> dict[str, Any]:
        """Every field, as stored beside the digest; a CPU identity leaves out ``offload``,
        so its JSON is the one stored before devices were named (a store keeps one JSON
        per digest)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = _plain(value)
        if self.backend == "cpu" and not self.offload:
            del out["offload"]
        return out

    @property
    def digest(self) -> str:
        """A stable, tagged SHA-256 of every field."""
        body = json.dumps(self.tiers(), sort_keys=True, separators=(",", ":"))
        return f"{IDENTITY_TAG}:" + hashlib.sha256(body.encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Identity:
        kwargs = dict(data)
        kwargs["loras"] = tuple((str(a), float(b)) for a, b in data["loras"])
        kwargs["kv_layout"] = tuple(tuple(x) for x in data["kv_layout"])
        return cls(**kwargs)

    def diff(self, other: Identity) -> list[str]:
        """Human-readable differences, e.g. ``["type_k: f16 → q8_0"]``."""
        a, b = self.as_dict(), other.as_dict()
        keys = [*a, *(k for k in b if k not in a)]
        return [
            f"{k}: {_show(a.get(k, ''))} → {_show(b.get(k, ''))}"
            for k in keys
            if a.get(k, "") != b.get(k, "")
        ]


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def probe_kv_layout(session: ModelSession) -> tuple[codec.KVState | None, str]:
    """Decode one token on an empty sequence and parse its state (then empty it again);
    for recurrent memory, set the session's ``snapshot_interval`` by its state's size.

    This shows the KV representation llama.cpp actually chose (types, row sizes,
    transposed V = flash attention off, the cell layout, checked against the
    model's) and proves the codec can read it; and,
    for memory with a partial part, that part's layout. The KV state is None
    for recurrent memory. Raises ``codec.StateFormatError`` for layouts localkv
    cannot cache.
    """
    if session.n_tokens:
        raise ValueError("probe_kv_layout needs an empty sequence")
    token = session.bos_token()
    kind = session.memory_kind
    refusal = memory_refusal(session.meta("general.architecture"))
    if kind is None or refusal is not None:
        raise codec.StateFormatError(refusal or session.memory_refusal or "unknown memory")
    try:
        session.decode_one(0 if token is None else token)
        kv = None if kind == "recurrent" else session.capture()
        if kind == "kv":
            return kv, ""
        if kind == "swa" and kv is not None and kv.cell_ext:
            raise codec.StateFormatError(
                "sliding-window memory with extended KV cells is not cached "
                "(its window's cells would need their tokens)"
            )
        info = partial.check_partial(read_state_ext(session.ctx, partial.PARTIAL_ONLY), kind, 1)
        if kind == "swa":  # blocks keep their own sliding rows (``kv.windows``)
            return kv, "rows1:" + info.layout
        # recurrent states are kept where they cost no more disk than the rows between
        rows = sum(x.k_row_bytes + x.v_row_bytes for x in kv.layers) if kv is not None else 0
        session.snapshot_interval = snapshot_interval(info.nbytes, rows, session.config.block_size)
        return kv, f"{info.layout}:{info.nbytes}"
    finally:
        session.reset()


def identity_of(session: ModelSession, hasher: FileHasher) -> Identity:
    """The identity of a freshly opened session (its sequence must be empty)."""
    cfg = session.config
    kv, partial_layout = probe_kv_layout(session)
    layout = kv.layout() if kv is not None else ()
    v_trans = kv.v_trans if kv is not None else False
    arch = session.meta("general.architecture") or "unknown"
    scale_factor = float(session.meta(f"{arch}.rope.scaling.factor") or 0.0)
    model_scale = 1.0 / scale_factor if scale_factor > 0 else 1.0
    cparams = llama_cpp.llama_context_default_params()
    return Identity(
        model_sha256=hasher.sha256(cfg.model_path),
        loras=tuple((hasher.sha256(x.path), float(x.scale)) for x in cfg.loras),
        rope_freq_base=cfg.rope_freq_base
        or float(session.meta(f"{arch}.rope.freq_base") or 10000.0),
        rope_freq_scale=cfg.rope_freq_scale or model_scale,
        rope_scaling_type=session.meta(f"{arch}.rope.scaling.type") or "none",
        yarn_ext_factor=float(cparams.yarn_ext_factor),
        yarn_attn_factor=float(cparams.yarn_attn_factor),
        yarn_beta_fast=float(cparams.yarn_beta_fast),
        yarn_beta_slow=float(cparams.yarn_beta_slow),
        n_ctx_orig=int(
            session.meta(f"{arch}.rope.scaling.original_context_length")
            or session.meta(f"{arch}.context_length")
            or 0
        ),
        type_k=cfg.type_k,
        type_v=cfg.type_v,
        architecture=arch,
        n_layer=session.n_layer(),
        kv_layout=tuple(
            (ggml_type_name(kt), kb, ggml_type_name(vt), vb) for kt, kb, vt, vb in layout
        ),
        v_trans=v_trans,
        memory_kind=session.memory_kind or "unknown",
        state_format=STATE_FORMAT,
        llama_cpp_python=llama_cpp_version(),
        backend=session.offload.backend(),
        offload=session.offload.split(),
        flash_attn=not v_trans,
        attn_threads=0 if v_trans else session.n_threads,
        system_info=system_info(),
        swa_window=int(llama_cpp.llama_model_n_swa(session.model)),
        swa_full=bool(cparams.swa_full) if session.memory_kind == "swa" else False,
        partial_layout=partial_layout,
        cell_ext=kv.cell_ext if kv is not None else False,
    )
