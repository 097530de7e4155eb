"""Pins a server's clients ask for: held within their share of the budget, never at the
cost of the user's own cache; the user's pins are never evicted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from localkv.storage import NewSnapshot
from localkv.storage.removal.budget import ENV_CLIENT_PINS, parse_share
from localkv.storage.store import SnapshotStore
from support.store import IDENTITY, make_chain, put_chain

BLOCK = 16


def _doc(i: int) -> list[int]:
    return [*range(1000 * (i + 1), 1000 * (i + 1) + 64)]  # four blocks, no block shared


def _save(store: SnapshotStore, i: int, *, pin: bool, share: int | None = None) -> str:
    blocks = make_chain(_doc(i), BLOCK)
    put_chain(store, blocks)
    return store.put_snapshot(
        NewSnapshot(
            tip=blocks[-1].hash,
            label=f"doc {i}",
            source_path=None,
            source_sha256=None,
            n_tokens=64,
            identity=IDENTITY,
            namespace="",
        ),
        pinned=pin,
        pinned_until=None,
        client_share=share,
    )


def _chain_bytes(store: SnapshotStore, snapshot: str) -> int:
    return sum(r.stored_bytes for r in store.chain_of(store.get_snapshot(snapshot).tip))


def _stored(store: SnapshotStore) -> set[str]:
    return {r[0] for r in store.db.execute("SELECT hash FROM blocks").fetchall()}


def _chain(i: int) -> set[str]:
    return {b.hash for b in make_chain(_doc(i), BLOCK)}


def test_a_clients_pin_is_made_within_its_share_and_refused_past_it(tmp_path: Path) -> None:
    with SnapshotStore.open(tmp_path / "c") as store:
        user = _save(store, 0, pin=True)  # the user's pin takes nothing of the clients' share
        size = _chain_bytes(store, user)
        share = 2 * size
        made = [_save(store, i, pin=True, share=share) for i in (1, 2)]
        refused = _save(store, 3, pin=True, share=share)
        rows = {s.id: s for s in store.snapshots()}
        assert [rows[s].pinned for s in made] == [True, True]
        assert [rows[s].pin_owner for s in made] == ["client", "client"]
        assert not rows[refused].pinned and rows[refused].pin_owner == "client"
        assert rows[user].pinned and rows[user].pin_owner is None
        # asking again for what is pinned costs nothing more: still made
        assert store.get_snapshot(_save(store, 1, pin=True, share=share)).pinned
        # a client's pin on what the user pinned leaves it the user's
        _save(store, 0, pin=True, share=0)
        assert store.get_snapshot(user).pin_owner is None
        # the user's `cache pin` makes a refused client pin a pin of the user's
        store.pin(refused)
        assert store.get_snapshot(refused).pinned
        assert store.get_snapshot(refused).pin_owner is None


def test_eviction_takes_refused_client_pins_first_and_never_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with SnapshotStore.open(tmp_path / "c") as store:
        pinned = _save(store, 0, pin=True)
        size = _chain_bytes(store, pinned)
        _save(store, 1, pin=False)  # the user's unpinned document, the oldest of all
        time.sleep(0.01)
        budget = 6 * size
        monkeypatch.setenv(ENV_CLIENT_PINS, str(size / budget))  # one client pin's room
        share = int(budget * parse_share(str(size / budget)))
        assert store.get_snapshot(_save(store, 2, pin=True, share=share)).pinned
        for i in range(3, 8):  # five more pins asked for: refused, saved unpinned
            assert not store.get_snapshot(_save(store, i, pin=True, share=share)).pinned
        assert store.evict(budget) > 0
        kept = _stored(store)
        # the user's pinned and unpinned documents and the client's pin that was made stay;
        # what went came from the refused pins alone
        assert _chain(0) | _chain(1) | _chain(2) <= kept
        assert kept - (_chain(0) | _chain(1) | _chain(2)) < set().union(
            *(_chain(i) for i in range(3, 8))
        )
        assert store.usage().stored_bytes <= budget
        # a lowered budget: the client's pin past its share is no longer kept; the user's are
        assert store.evict(0) > 0
        assert _stored(store) == _chain(0)


@pytest.mark.parametrize(
    ("text", "share"), [("0.25", 0.25), ("25%", 0.25), ("0", 0.0), (" 1 ", 1.0)]
)
def test_a_share_is_a_fraction_or_a_percentage(text: str, share: float) -> None:
    assert parse_share(text) == share


@pytest.mark.parametrize("text", ["", "abc", "-0.1", "1.5", "150%", "nan"])
def test_a_share_past_the_budget_or_not_a_number_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a share"):
        parse_share(text)
