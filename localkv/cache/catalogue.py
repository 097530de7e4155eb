"""Snapshots as the runtime keeps them: saving one for a prefill, the listing, and
which one a restore used.

A pin is the user's (``True``: ``prefill --pin``, ``cache pin``) or a server's
client's (``ClientPin``: ``cache_control``, ``"pin": true``): a client's holds only
within the clients' share of the budget (``LOCALKV_CLIENT_PINS``); past it the
snapshot is saved unpinned, and ``pinned`` says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from localkv.cache.budgeting import fit_budget
from localkv.cache.naming import covering
from localkv.cache.prefix import PrefixCache, RestoreResult, SaveResult
from localkv.model.session import ModelSession
from localkv.prompt.request import Document, path_text
from localkv.storage import NewSnapshot
from localkv.storage.disk import check_free_space
from localkv.storage.removal.budget import client_share
from localkv.storage.store import SnapshotStore
from localkv.storage.values import Block

__all__ = [
    "ClientPin",
    "client_pin_fits",
    "covering_snapshot",
    "document_label",
    "has_room",
    "pinned",
    "save_prefill",
    "save_snapshot",
    "source_sha",
]


@dataclass(frozen=True, slots=True)
class ClientPin:
    """A pin a server's client asked for: until ``until`` (seconds since the epoch; None:
    for good), made only within the clients' share of the budget."""

    until: float | None = None


log = logging.getLogger(__name__)


def covering_snapshot(
    store: SnapshotStore, namespace: str, result: RestoreResult, tokens: list[int]
) -> str | None:
    """The longest snapshot of ``namespace`` that the restored prefix of ``tokens`` contains."""
    return covering(store, namespace, result.chain, result.reused, tokens)


def save_snapshot(  # noqa: PLR0913 - to take a value type
    cache: PrefixCache,
    tip: str,
    documents: Sequence[Document],
    n_tokens: int,
    *,
    label: str | None,
    pin: bool | ClientPin,
    system: str | None = None,
) -> str | None:
    """Name the chain ending at ``tip`` after its documents; None if it cannot be saved.

    ``system``: the system prompt it was made with ("": none; None: not known), by
    which a miss for the same documents under another one names this snapshot.

    ``pin``: the user's pin for good, or a client's (``ClientPin``), which holds only
    within the clients' share of the budget (``pinned`` says whether it was made).

    None too when the index was deleted while the chain was saved: the id would
    name a row no later process finds (its manifest lets ``cache repair`` bring
    it back).
    """
    if not cache.saving:
        return None
    share = _client_share(cache) if isinstance(pin, ClientPin) else None
    try:
        snapshot = cache.store.put_snapshot(
            NewSnapshot(
                tip=tip,
                label=label or ", ".join(document_label(d) for d in documents) or "(system prompt)",
                source_path=_source_path(documents),
                source_sha256=source_sha(documents),
                n_tokens=n_tokens,
                identity=cache.identity.digest,
                namespace=cache.namespace,
                system=system,
            ),
            pinned=bool(pin),
            pinned_until=pin.until if isinstance(pin, ClientPin) else None,
            client_share=share,
        )
    except (OSError, sqlite3.Error, ValueError) as exc:  # disk full; tip evicted
        log.warning("could not save the snapshot (%s); continuing without it", exc)
        return None
    return None if cache.index_lost() else snapshot


def _client_share(cache: PrefixCache) -> int:
    return client_share(cache.budget_bytes or cache.store.default_budget())


def client_pin_fits(cache: PrefixCache, tip: str) -> bool:
    """Whether a client's pin on the chain ending at ``tip`` would be made now."""
    try:
        return cache.store.client_pin_fits(tip, _client_share(cache))
    except (OSError, sqlite3.Error, ValueError) as exc:
        log.warning("could not count the clients' pins: %s", exc)
        return False


def pinned(cache: PrefixCache, snapshot: str | None) -> bool:
    """Whether ``snapshot``'s pin holds (False: none, or a client's refused, or an error)."""
    if snapshot is None:
        return False
    try:
        return cache.store.get_snapshot(snapshot).pinned
    except (KeyError, OSError, sqlite3.Error) as exc:
        log.warning("could not read the snapshot's pin: %s", exc)
        return False


def document_label(document: Document) -> str:
    """How a snapshot and the chat name a document: its file name (``LICENSE``), not the
    path it was given by, so one document gets one snapshot from every face."""
    return path_text(document.path.name) if document.path is not None else document.name


@dataclass(frozen=True, slots=True)
class SnapshotName:
    """How the snapshot of a saved prefill is named and pinned."""

    label: str | None  # None: from its documents (``document_label``)
    pin: bool | ClientPin = False
    system: str | None = None  # the system prompt ("": none; None: not known)


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedPrefill:
    """A prefill's save: its blocks, its snapshot, the chain on disk."""

    saved: SaveResult
    snapshot: str | None  # the snapshot's id; None when none was saved
    bytes_on_disk: int  # the saved chain's
    kept: int  # where the saved chain ends: the prefix the next run restores


def save_prefill(
    cache: PrefixCache | None,
    session: ModelSession,
    tips: list[int],
    documents: Sequence[Document],
    name: SnapshotName | None,
    *,
    seconds_per_token: float,
) -> SavedPrefill:
    """Save a prefill's blocks now, then its snapshot as ``name`` says (None: no
    snapshot, the prefill was cancelled)."""
    if cache is None:
        nothing = SaveResult(blocks=0, new_blocks=0, new_bytes=0, tip=None)
        return SavedPrefill(saved=nothing, snapshot=None, bytes_on_disk=0, kept=0)
    saved, blocks = _write(cache, lambda: cache.prepare(session, tips, seconds_per_token))
    snapshot = None
    if saved.tip is not None and name is not None:
        snapshot = save_snapshot(
            cache,
            saved.tip,
            documents,
            tips[-1],
            label=name.label,
            pin=name.pin,
            system=name.system,
        )
    saved = fit_budget(cache, saved)  # evicts; says if that took this very chain
    snapshot = None if saved.not_kept else snapshot
    tip = saved.tip if saved.error is None else _stored_tip(cache, blocks)
    chain = cache.store.chain_of(tip) if tip is not None else []
    kept = chain[-1].end if chain and not saved.not_kept else 0
    if chain:  # the chain's blocks, as `cache show` counts them (not a segment end's beside it)
        saved = dataclasses.replace(saved, blocks=len(chain))
    on_disk = sum(r.stored_bytes for r in chain)
    return SavedPrefill(saved=saved, snapshot=snapshot, bytes_on_disk=on_disk, kept=kept)


_ATTEMPTS = 3


def _write(
    cache: PrefixCache, prepare: Callable[[], list[Block]]
) -> tuple[SaveResult, list[Block]]:
    """Prepare the blocks and write them; again when that failed while the disk has room:
    another process evicted a block the chain needed meanwhile (prepared again from
    the session, it is written back), or an I/O error passed. A disk without room
    fails at once, and the caller says so."""
    for _ in range(_ATTEMPTS - 1):
        blocks = prepare()
        saved = cache.write(blocks)
        if saved.error is None or not has_room(cache):
            return saved, blocks
    blocks = prepare()
    return cache.write(blocks), blocks


def has_room(cache: PrefixCache) -> bool:
    """Whether a block may be saved at all: free space beyond ``LOCALKV_MIN_FREE``."""
    try:
        check_free_space(cache.store.layout.tmp, 0)
    except (OSError, ValueError):
        return False
    return True


def _stored_tip(cache: PrefixCache, blocks: Sequence[Block]) -> str | None:
    """After a failed save: the last of ``blocks`` stored with every block before it
    (what earlier saves kept), or None."""
    tip = None
    for block in blocks:
        if not cache.store.has_block(block.hash):
            break
        tip = block.hash
    return tip


def _source_path(documents: Sequence[Document]) -> str | None:
    paths = [path_text(d.path.resolve()) for d in documents if d.path is not None]
    return paths[0] if len(paths) == 1 else ("; ".join(paths) or None)


def source_sha(documents: Sequence[Document]) -> str | None:
    """The documents' content, as a snapshot records it (``source_sha256``)."""
    if not documents:
        return None
    if len(documents) == 1:
        return documents[0].sha256
    return hashlib.sha256("".join(d.sha256 for d in documents).encode()).hexdigest()
