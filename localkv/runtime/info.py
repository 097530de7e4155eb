"""What a runtime tells about itself: the model it loaded and the cache's snapshots.

The chat's context panel and cache screen show these; the server's
``/v1/localkv/cache`` answers with ``SnapshotInfo.as_json``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from localkv.cache.naming import model_names
from localkv.storage.store import SnapshotStore

__all__ = ["LoadedModel", "SnapshotInfo", "list_snapshots"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedModel:
    """The model a runtime holds, as the faces show it."""

    name: str  # the file's stem, as ``localkv models`` and the server name it
    description: str  # as ``localkv models`` shows the file (``llama 135M Q4_1``)
    path: str
    file_bytes: int
    n_gpu_layers: int  # layers on a device, the output layer counted: 0 on a CPU-only build
    device: str = ""  # the device they are on (``Vulkan0``), empty when none is
    type_k: str
    type_v: str
    flash_attn: str  # ``on``/``off`` as llama.cpp chose it, else the setting
    n_ctx: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotInfo:
    """One snapshot of the runtime's namespace, of any model."""

    id: str
    label: str
    model: str  # as ``localkv models`` names it
    this_model: bool  # of the loaded model's cache identity: only those restore
    tokens: int
    frees_bytes: int  # what removing it frees now: the blocks no other snapshot needs
    bytes_on_disk: int  # the blocks of its chain, shared ones included
    hits: int
    last_used: float  # seconds since the epoch
    pinned: bool
    pinned_until: float | None  # when a pin lapses (None: for good, or not pinned)

    def as_json(self) -> dict[str, object]:
        """The fields by name, in the order above."""
        return dataclasses.asdict(self)


def list_snapshots(
    store: SnapshotStore, namespace: str, identity: str | None
) -> list[SnapshotInfo]:
    """The namespace's snapshots, oldest first; ``identity``: the loaded model's cache
    identity (None: no snapshot is this model's)."""
    space = store.space(namespace)
    snaps = [s for s in store.snapshots(namespace) if s.id in space.snapshots]
    names = model_names(store, (snap.identity for snap in snaps))
    return [
        SnapshotInfo(
            id=snap.id,
            label=snap.label,
            model=names[snap.identity],
            this_model=snap.identity == identity,
            tokens=snap.n_tokens,
            frees_bytes=space.snapshots[snap.id].frees,
            bytes_on_disk=sum(row.stored_bytes for row in store.chain_of(snap.tip)),
            hits=snap.hits,
            last_used=snap.last_used,
            pinned=snap.pinned,
            pinned_until=snap.pinned_until if snap.pinned else None,
        )
        for snap in snaps
    ]
