"""The size budget and namespace isolation, through the CLI in real processes.

``LOCALKV_BUDGET`` bounds the cache; pinned snapshots are never evicted, so a
warning says when they alone hold more than it. A save whose own eviction
removed what it saved says so instead of naming a snapshot that is gone.
``cache gc`` evicts down to the budget, least valuable (here: least recently
used) first, pinned never. ``cache stats`` counts one namespace and names no
other. ``cache forget`` counts only the bytes it really freed: a block file
behind a symlinked fan-out directory is outside the cache and is left alone.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from localkv.storage import NewSnapshot
from localkv.storage.store import SnapshotStore
from support.store import IDENTITY, make_chain, put_chain
from support.tinymodels import TinyModels

LIVENESS_S = 120  # far beyond what these commands take; only a hang reaches it
SMALL = "100K"  # less than one document's chain (3 blocks of the tiny model, ~340 KiB)
LARGE = "1G"
_SNAPSHOT_LINE = re.compile(r"^snapshot ([0-9a-f]{12})$", re.MULTILINE)


@pytest.fixture()
def env(tmp_path: Path, tiny_models: TinyModels) -> dict[str, str]:
    return {
        **os.environ,
        "LOCALKV_MODEL": str(tiny_models.base),
        "LOCALKV_HOME": str(tmp_path / "cache"),
        "LOCALKV_BUDGET": LARGE,
    }


@pytest.fixture()
def docs(tmp_path: Path, long_text: str) -> list[Path]:
    """Three documents of about 650 tokens each, sharing no block."""
    out = []
    for name in ("a", "b", "c"):
        path = tmp_path / f"{name}.txt"
        path.write_text(f"Document {name.upper()}. " + long_text[:2600], encoding="utf-8")
        out.append(path)
    return out


def _localkv(
    env: dict[str, str], *args: str, budget: str | None = None
) -> subprocess.CompletedProcess[str]:
    run_env = env if budget is None else {**env, "LOCALKV_BUDGET": budget}
    done = subprocess.run(
        [sys.executable, "-m", "localkv", *args],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=LIVENESS_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (args, done.stderr)
    return done


def _prefill(env: dict[str, str], doc: Path, *extra: str, budget: str | None = None) -> dict:
    done = _localkv(env, "prefill", "--threads", "1", "--json", *extra, str(doc), budget=budget)
    out: dict = json.loads(done.stdout.splitlines()[-1])
    return out


def _snapshots(env: dict[str, str], *extra: str) -> dict[str, dict]:
    listing = json.loads(_localkv(env, "cache", "ls", "--json", *extra).stdout)
    return {s["label"]: s for s in listing}


def _stats(env: dict[str, str], *extra: str, budget: str | None = None) -> dict:
    out: dict = json.loads(_localkv(env, "cache", "stats", "--json", *extra, budget=budget).stdout)
    return out


def test_pinned_snapshots_over_the_budget_are_warned_about(
    env: dict[str, str], docs: list[Path]
) -> None:
    quiet = _localkv(env, "prefill", "--threads", "1", "--pin", str(docs[0]))
    assert "warning" not in quiet.stderr  # within budget: nothing to say
    loud = _localkv(env, "prefill", "--threads", "1", "--pin", str(docs[1]), budget=SMALL)
    assert "pinned snapshots hold" in loud.stderr and "LOCALKV_BUDGET" in loud.stderr
    # pinned means kept, over the budget or not
    assert set(_snapshots(env)) == {docs[0].name, docs[1].name}
    assert "over the cache budget" in _localkv(env, "cache", "ls", budget=SMALL).stderr
    assert "warning" not in _localkv(env, "cache", "ls").stderr
    stats = _localkv(env, "cache", "stats", budget=SMALL)
    assert "over the cache budget" in stats.stderr
    assert "100.0 KiB for the whole cache" in stats.stdout
    budget = _stats(env, budget=SMALL)["budget"]
    assert budget["budget_bytes"] == 100 * 1024
    assert budget["pinned_bytes"] == budget["stored_bytes"] > 3 * budget["budget_bytes"]
    assert budget["pinned_over_budget"] is True and budget["over_budget"] is True


def test_a_snapshot_its_own_save_evicted_is_never_reported_as_saved(
    env: dict[str, str], docs: list[Path]
) -> None:
    done = _localkv(env, "prefill", "--threads", "1", str(docs[0]), budget=SMALL)
    assert _SNAPSHOT_LINE.search(done.stdout) is None, done.stdout
    assert "snapshot not kept" in done.stdout and "too small" in done.stdout
    assert "0 B on disk" in done.stdout
    report = _prefill(env, docs[0], budget=SMALL)
    assert report["snapshot"] is None and report["bytes_on_disk"] == 0
    assert "LOCALKV_BUDGET" in report["not_kept"]
    assert _snapshots(env) == {}
    # with room for it, the id printed is a snapshot that exists
    kept = _localkv(env, "prefill", "--threads", "1", str(docs[0]))
    found = _SNAPSHOT_LINE.search(kept.stdout)
    assert found is not None and "not kept" not in kept.stdout
    assert _snapshots(env)[docs[0].name]["id"] == found.group(1)


def test_an_ask_whose_blocks_were_evicted_at_once_says_so(
    env: dict[str, str], docs: list[Path]
) -> None:
    ask = ("ask", "--threads", "1", "--max-tokens", "2", str(docs[0]), "What is it?")
    done = _localkv(env, *ask, budget=SMALL)
    assert "cache blocks were not kept" in done.stderr and "too small" in done.stderr
    assert _stats(env)["blocks"] == 0
    assert "not kept" not in _localkv(env, *ask).stderr
    assert _stats(env)["blocks"] > 0


def _age(env: dict[str, str], snapshot_id: str, days: float) -> None:
    """Mark a snapshot and its chain as last used ``days`` ago (what eviction weighs)."""
    when = time.time() - days * 86400
    db = sqlite3.connect(Path(env["LOCALKV_HOME"]) / "index.db")
    try:
        with db:
            (tip,) = db.execute("SELECT tip FROM snapshots WHERE id = ?", (snapshot_id,)).fetchone()
            db.execute(
                "WITH RECURSIVE c(hash) AS (SELECT ? UNION SELECT b.parent FROM blocks b "
                "JOIN c ON b.hash = c.hash WHERE b.parent IS NOT NULL) "
                "UPDATE blocks SET last_used = ? WHERE hash IN (SELECT hash FROM c)",
                (tip, when),
            )
            db.execute("UPDATE snapshots SET last_used = ? WHERE id = ?", (when, snapshot_id))
    finally:
        db.close()


def test_gc_evicts_down_to_the_budget_least_recently_used_first_pinned_never(
    env: dict[str, str], docs: list[Path]
) -> None:
    a, b, c = (_prefill(env, d, *(["--pin"] if d == docs[2] else [])) for d in docs)
    sizes = {r["snapshot"]: r["bytes_on_disk"] for r in (a, b, c)}
    _age(env, a["snapshot"], days=30)  # a: unpinned, used long ago
    _age(env, c["snapshot"], days=60)  # c: pinned, older still
    room = str(sizes[b["snapshot"]] + sizes[c["snapshot"]] + 1024)
    gc = json.loads(_localkv(env, "cache", "gc", "--json", budget=room).stdout)
    assert set(_snapshots(env)) == {docs[1].name, docs[2].name}
    assert gc["evicted_bytes"] == sizes[a["snapshot"]]
    # far too small: every unpinned block goes, the pinned snapshot stays (and is warned of)
    tight = _localkv(env, "cache", "gc", budget=SMALL)
    assert "over the cache budget" in tight.stderr
    assert set(_snapshots(env)) == {docs[2].name}
    # unpinned, nothing protects it: gc brings the cache within the budget
    _localkv(env, "cache", "unpin", c["snapshot"])
    gc = json.loads(_localkv(env, "cache", "gc", "--json", budget=SMALL).stdout)
    assert _snapshots(env) == {}
    budget = _stats(env, budget=SMALL)["budget"]
    assert budget["stored_bytes"] <= budget["budget_bytes"] and budget["over_budget"] is False
    assert gc["evicted_bytes"] == sizes[c["snapshot"]]


def test_stats_of_one_namespace_name_no_other(env: dict[str, str], docs: list[Path]) -> None:
    ask = ("ask", "--threads", "1", "--max-tokens", "2")
    _localkv(env, *ask, "--namespace", "alpha", str(docs[0]), "What is it?")
    _localkv(env, *ask, "--namespace", "beta-secret", str(docs[1]), "Who is it?")
    _prefill(env, docs[2], "--namespace", "beta-secret")
    alpha = _stats(env, "--namespace", "alpha")
    assert "beta" not in json.dumps(alpha)
    assert alpha["namespace"] == "alpha" and alpha["not_cached_yet"] == 1
    assert alpha["misses"] == 0 and alpha["misses_by_reason"] == {}  # a first run is no miss
    assert alpha["snapshots"] == len(_snapshots(env, "--namespace", "alpha")) == 0
    beta = _stats(env, "--namespace", "beta-secret")
    assert "alpha" not in json.dumps(beta)
    assert beta["snapshots"] == 1 and beta["blocks"] > alpha["blocks"] > 0
    # the budget's use is the whole cache's: both namespaces' bytes, no names
    whole = alpha["budget"]["stored_bytes"]
    assert whole == alpha["stored_bytes"] + beta["stored_bytes"] == beta["budget"]["stored_bytes"]
    text = _localkv(env, "cache", "stats", "--namespace", "alpha").stdout
    assert "beta" not in text and "alpha" in text
    default = _stats(env)  # the active namespace when none is given
    assert default["namespace"] == "default" and default["misses_by_reason"] == {}
    assert default["blocks"] == 0


def test_forget_counts_only_the_bytes_it_freed(
    env: dict[str, str], docs: list[Path], tmp_path: Path
) -> None:
    _prefill(env, docs[0])
    blocks = Path(env["LOCALKV_HOME"]) / "blocks"
    fans = sorted(p for p in blocks.iterdir() if p.is_dir())
    files = {f: f.stat().st_size for fan in fans for f in fan.iterdir()}
    assert len(fans) >= 2, "the chain's blocks share one fan-out directory"
    moved, outside = fans[0], tmp_path / "outside" / fans[0].name
    outside.parent.mkdir()
    moved.rename(outside)
    moved.symlink_to(outside, target_is_directory=True)
    kept = {outside / f.name: size for f, size in files.items() if f.parent == moved}
    freed = sum(size for f, size in files.items() if f.parent != moved)
    report = json.loads(
        _localkv(env, "cache", "forget", "--json", str(docs[0])).stdout.splitlines()[-1]
    )
    assert report["blocks"] == len(files)
    assert report["bytes_freed"] == freed
    # the files behind the link are outside the cache: never followed, never deleted
    assert {f: f.stat().st_size for f in outside.iterdir()} == kept


def test_the_store_counts_pinned_bytes_once_and_events_per_namespace(tmp_path: Path) -> None:
    """Under the CLI: ``usage`` counts a block two pinned snapshots share once, and
    ``stats(namespace)`` counts that namespace's rows and events alone."""
    with SnapshotStore.open(tmp_path / "store") as store:
        shared = make_chain(list(range(1, 33)), 16, namespace="a")
        longer = make_chain(list(range(1, 49)), 16, namespace="a")
        other = make_chain(list(range(100, 132)), 16, namespace="b")
        for chain in (shared, longer, other):
            put_chain(store, chain)
        sizes = {r.hash: r.stored_bytes for r in store.all_blocks()}
        for chain, pin in ((shared, True), (longer, True), (other, False)):
            ns = chain[-1].namespace
            end = chain[-1].end
            store.put_snapshot(
                NewSnapshot(
                    tip=chain[-1].hash,
                    label=f"{ns}{end}",
                    source_path=None,
                    source_sha256=None,
                    n_tokens=end,
                    identity=IDENTITY,
                    namespace=ns,
                ),
                pinned=pin,
            )
        store.record_event("miss", "no stored prefix in namespace 'b'", 5, 0.0, "b")
        store.record_event("hit", None, 32, 0.01, "a")
        a_bytes = sum(sizes[b.hash] for b in longer)  # ``shared`` is its first two blocks
        assert store.usage("a").pinned_bytes == a_bytes == store.usage().pinned_bytes
        assert store.usage("b").pinned_bytes == 0
        assert store.usage().stored_bytes == sum(sizes.values())
        a, b = store.stats("a"), store.stats("b")
        assert (a["hits"], a["misses"], a["misses_by_reason"]) == (1, 0, {})
        assert (b["hits"], b["misses"]) == (0, 1)
        assert (a["blocks"], a["snapshots"], b["blocks"], b["snapshots"]) == (3, 2, 2, 1)
        assert a["stored_bytes"] == a_bytes and store.stats()["blocks"] == 5
        store.unpin(store.snapshots("a")[1].id)
        assert store.usage("a").pinned_bytes == sum(sizes[b.hash] for b in shared)
