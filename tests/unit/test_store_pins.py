"""Pins that lapse: a snapshot pinned until a time is protected until then, not after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from localkv.storage import NewSnapshot, manifests
from localkv.storage.store import SnapshotStore
from support.store import IDENTITY, make_chain, put_chain

DOC = [*range(32), *range(1000, 1040)]
OTHER = [*range(500, 560)]


def _snapshot(store: SnapshotStore, tokens: list[int], label: str, until: float | None) -> str:
    blocks = make_chain(tokens, 16)
    put_chain(store, blocks)
    tip = blocks[-1].hash
    return store.put_snapshot(
        NewSnapshot(
            tip=tip,
            label=label,
            source_path=None,
            source_sha256=None,
            n_tokens=len(tokens),
            identity=IDENTITY,
            namespace="",
        ),
        pinned=True,
        pinned_until=until,
    )


def _stored(store: SnapshotStore) -> set[str]:
    return {r[0] for r in store.db.execute("SELECT hash FROM blocks").fetchall()}


def test_a_pin_with_a_time_protects_across_a_reopen_then_lapses(tmp_path: Path) -> None:
    until = time.time() + 1.5
    with SnapshotStore.open(tmp_path / "c") as store:
        sid = _snapshot(store, DOC, "doc", until)
        other = _snapshot(store, OTHER, "other", time.time() - 1)  # already lapsed
        snap = store.get_snapshot(sid)
        assert (snap.pinned, snap.pinned_until) == (True, until)
        assert not store.get_snapshot(other).pinned
        pinned_bytes = store.usage().pinned_bytes
    chain = {b.hash for b in make_chain(DOC, 16)}
    with SnapshotStore.open(tmp_path / "c") as store:  # kept in the index: a restart keeps it
        assert store.get_snapshot(sid).pinned_until == until
        assert store.usage().pinned_bytes == pinned_bytes > 0
        assert store.evict(0) > 0
        assert _stored(store) == chain  # the lapsed pin protected nothing
        time.sleep(max(0.0, until - time.time()) + 0.1)
        assert not store.get_snapshot(sid).pinned
        assert store.usage().pinned_bytes == 0
        assert store.evict(0) > 0
        assert _stored(store) == set()


def test_a_pin_is_extended_never_shortened_and_a_pin_for_good_stays(tmp_path: Path) -> None:
    with SnapshotStore.open(tmp_path / "c") as store:
        later = time.time() + 3600
        sid = _snapshot(store, DOC, "doc", later)
        assert _snapshot(store, DOC, "doc", time.time() + 300) == sid
        assert store.get_snapshot(sid).pinned_until == later  # not shortened
        assert _snapshot(store, DOC, "doc", later + 60) == sid
        assert store.get_snapshot(sid).pinned_until == later + 60
        found, bad = manifests.read_all(store.layout)
        assert bad == [] and [(m.id, m.pinned_until) for m, _ in found] == [(sid, later + 60)]
        store.pin(sid)  # ``cache pin``: for good
        assert store.get_snapshot(sid).pinned_until is None
        _snapshot(store, DOC, "doc", time.time() + 1)
        snap = store.get_snapshot(sid)
        assert (snap.pinned, snap.pinned_until) == (True, None)
        store.unpin(sid)
        assert not store.get_snapshot(sid).pinned


def test_cache_ls_shows_until_when_a_pin_holds(tmp_path: Path) -> None:
    with SnapshotStore.open(tmp_path / "c") as store:
        until = time.time() + 3600
        _snapshot(store, DOC, "for a while", until)
        _snapshot(store, OTHER, "for good", None)
    env = {**os.environ, "COLUMNS": "200"}
    args = ["cache", "ls", "--cache-dir", str(tmp_path / "c")]
    out = subprocess.run(
        [sys.executable, "-m", "localkv", *args], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines()[2:] if not line.startswith("total ")]
    pins = {line.split("  ")[1].strip(): line.rstrip() for line in rows}
    stamp = time.strftime("%m-%d %H:%M", time.localtime(until))
    assert pins["for a while"].endswith(f"  to {stamp}") and pins["for good"].endswith("  yes")
    listing = json.loads(
        subprocess.run(
            [sys.executable, "-m", "localkv", *args, "--json"], capture_output=True, text=True
        ).stdout
    )
    assert sorted((s["label"], s["pinned"], s["pinned_until"]) for s in listing) == [
        ("for a while", True, until),
        ("for good", True, None),
    ]
