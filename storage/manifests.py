"""Snapshot manifests: each snapshot's row, kept as a small file beside the index.

Block files carry their own index rows (``formats/blockcodec.py``); a
snapshot's row (label, source path and SHA-256, pinned, created) lives only
in ``index.db``. So each snapshot also has ``snapshots/<id>.json`` (0600,
written atomically through ``tmp/``), with its identity's JSON, from which
``repair`` restores the snapshot when the index is lost. The catalogue writes
it when a snapshot is saved, pinned or unpinned and removes it with the
snapshot; ``prune`` removes those whose snapshot left the index another way
(eviction, quarantine, ``forget``). Hit counts and last-used times are not
kept here (they change on every restore). A manifest is only a hint: repair
uses one only if its tip block was recovered, under the same identity,
namespace and length.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .disk import locked_temp_file, remove_file
from .index.rows import CLIENT
from .paths import CacheLayout, ensure_private_dir, fsync_dir
from .values import SnapshotRow

__all__ = ["MANIFEST_FORMAT", "Manifest", "manifest_dir", "prune", "read_all", "remove", "write"]

logger = logging.getLogger(__name__)

MANIFEST_FORMAT = "lkv-snapshot1"
_SUFFIX = ".json"
_MAX_BYTES = 1 << 20

Manifest = tuple[SnapshotRow, str | None]  # the row, its identity's JSON if known


def manifest_dir(layout: CacheLayout) -> Path:
    return layout.root / "snapshots"


def _path(layout: CacheLayout, snapshot_id: str) -> Path:
    if not snapshot_id.isalnum():
        raise ValueError(f"not a snapshot id: {snapshot_id!r}")
    return manifest_dir(layout) / f"{snapshot_id}{_SUFFIX}"


def write(layout: CacheLayout, snap: SnapshotRow, identity_json: str | None) -> None:
    """Write (or replace) the manifest of ``snap``."""
    fields = {
        "format": MANIFEST_FORMAT,
        "id": snap.id,
        "tip": snap.tip,
        "label": snap.label,
        "source_path": snap.source_path,
        "source_sha256": snap.source_sha256,
        "system": snap.system,
        "n_tokens": snap.n_tokens,
        "identity": snap.identity,
        "namespace": snap.namespace,
        "created": snap.created,
        "pinned": snap.pinned,
        "pinned_until": snap.pinned_until,
        "pin_owner": snap.pin_owner,
        "identity_json": identity_json,
    }
    target = _path(layout, snap.id)
    ensure_private_dir(target.parent)
    with locked_temp_file(layout, f"{snap.id}.manifest") as (tmp, fd):
        with os.fdopen(os.dup(fd), "w", encoding="utf-8") as f:  # the lock stays on ``fd``
            json.dump(fields, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    fsync_dir(target.parent)


def remove(layout: CacheLayout, snapshot_id: str) -> None:
    """Remove a snapshot's manifest (nothing if it has none)."""
    remove_file(_path(layout, snapshot_id))


def _ids(layout: CacheLayout) -> list[str]:
    try:
        names = os.listdir(manifest_dir(layout))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [n[: -len(_SUFFIX)] for n in names if n.endswith(_SUFFIX) and n[:-5].isalnum()]


def prune(layout: CacheLayout, keep: set[str]) -> int:
    """Remove the manifests of snapshots not in ``keep`` whose tip block file is gone.

    A manifest whose tip file is still on disk stays even when the index has no
    row for it: the index may have been lost, and ``repair`` needs the manifest
    to bring the snapshot back. Removing, evicting or forgetting a snapshot
    deletes its files, so its manifest goes with them. Returns how many went.
    """
    gone = 0
    for snapshot_id in _ids(layout):
        if snapshot_id in keep or _tip_on_disk(layout, snapshot_id):
            continue
        remove(layout, snapshot_id)
        gone += 1
    return gone


def _tip_on_disk(layout: CacheLayout, snapshot_id: str) -> bool:
    try:
        tip = _parse(_path(layout, snapshot_id))[0].tip
        return layout.resolve(layout.block_relpath(tip)).is_file()
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return False  # an unreadable manifest can bring nothing back


def _parse(path: Path) -> Manifest:
    if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX_BYTES:
        raise ValueError("not a regular file of at most 1 MiB")
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"not a {MANIFEST_FORMAT} manifest")
    created = float(data["created"])
    row = SnapshotRow(
        id=str(data["id"]),
        tip=str(data["tip"]),
        label=str(data["label"]),
        source_path=None if data["source_path"] is None else str(data["source_path"]),
        source_sha256=None if data["source_sha256"] is None else str(data["source_sha256"]),
        system=None if data.get("system") is None else str(data["system"]),
        n_tokens=int(data["n_tokens"]),
        identity=str(data["identity"]),
        namespace=str(data["namespace"]),
        created=created,
        last_used=created,
        hits=0,
        pinned=bool(data["pinned"]),
        pinned_until=_until(data.get("pinned_until")),
        pin_owner=_owner(data.get("pin_owner")),  # absent before clients' pins were told apart
    )
    if path.name != f"{row.id}{_SUFFIX}":
        raise ValueError(f"names snapshot {row.id}")
    identity = data.get("identity_json")
    return row, identity if isinstance(identity, str) else None


def read_all(layout: CacheLayout) -> tuple[list[Manifest], list[tuple[str, str]]]:
    """Every readable manifest, and (file name, reason) of those that are not."""
    found: list[Manifest] = []
    bad: list[tuple[str, str]] = []
    for snapshot_id in sorted(_ids(layout)):
        path = _path(layout, snapshot_id)
        try:
            found.append(_parse(path))
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            bad.append((path.name, f"manifest cannot be read: {exc}"))
    return found, bad


def _until(value: object) -> float | None:
    """A manifest's ``pinned_until`` (absent in manifests written before pins could lapse)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("pinned_until must be a number")
    return float(value)


def _owner(value: object) -> str | None:
    """A manifest's ``pin_owner``: None (the user's) or ``client``."""
    if value is None:
        return None
    if value == CLIENT:
        return CLIENT
    raise ValueError("pin_owner must be null or 'client'")
