"""A restore at a length no prefill here reaches: a chain of random rows (``chain``), timed.

``measure_synthetic(model, n, repeats, work)`` stores the request of ``n``
tokens of the bench text as a synthetic chain (``chain.synthetic_prefill``,
then ``Runtime.save_prefix``), then in a fresh ``Runtime`` on that store:

1. restores it (``Runtime.restore``, verified) with the block files in the page
   cache: the first restore of the process, then ``repeats`` more; then times
   llama.cpp's own load of the packed stream alone (``_llama_loads``);
2. ``repeats`` times, drops every file of the store from the page cache
   (``floors.drop``) and restores it again;

Before each warm step the store's files are written to the disk (``os.sync``):
the kernel writing back the gigabytes the bench has just written would be timed
with the restores otherwise. Then, with the runtime closed, it measures the
floors: a copy of as many bytes as the restored state
(``llama_state_seq_get_size``), and a sequential read of the store's files,
dropped and in the page cache. Every restore's seconds are
``RestoreResult.breakdown``'s steps.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import statistics
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from localkv.bench.geometry.chain import synthetic_prefill
from localkv.bench.geometry.counters import tree_bytes
from localkv.bench.geometry.floors import (
    cached_bytes,
    drop,
    files_under,
    huge_mapped_bytes,
    memcpy_seconds,
    read_seconds,
)
from localkv.bench.geometry.measure import document_for, session_config
from localkv.model.native import llama_cpp
from localkv.prompt.request import Request
from localkv.runtime import Runtime
from localkv.storage.packed import BUDGET_SHARE, PackedState
from localkv.storage.packed import SUFFIX as PACKED

__all__ = ["Stored", "measure_synthetic", "store_synthetic"]

PROBE = "probe"
STEPS = ("lookup", "read", "columns", "load", PROBE)  # in the order a restore takes them
# the steps that make up a restore's time: ``columns`` is a part of ``read``, on the reader
# threads (``RestoreResult.breakdown``), told apart
TIMED = ("lookup", "read", "load")


@dataclass(frozen=True, slots=True, kw_only=True)
class Stored:
    """A synthetic chain in a store: its request, schedule and what making it took."""

    request: Request
    ends: list[int]
    build_s: float  # synthetic_prefill
    save_s: float  # save_prefix, the write waited for


def store_synthetic(model: Path, n: int, store: Path) -> Stored:
    """The request of ``n`` tokens of the bench text, stored in ``store`` as a synthetic chain."""
    with Runtime(session_config(model, n), cache_dir=store) as rt:
        if rt.cache is None:
            raise RuntimeError(f"no cache: {rt.cache_error}")
        request = rt.build([document_for(rt, n)], system=None)
        ends = rt.schedule(request)
        t0 = time.perf_counter()
        synthetic_prefill(rt.session, request.tokens, ends)
        t1 = time.perf_counter()
        # room for the whole chain, whatever the default budget (a share of the free disk)
        state = int(llama_cpp.llama_state_seq_get_size(rt.session.ctx, 0))
        rt.cache.budget_bytes = max(rt.cache.store.default_budget(), 2 * state)
        rt.save_prefix(request.boundaries)
        saved = rt.wait_for_saves()
        t2 = time.perf_counter()
    n_tokens = len(request.tokens)
    if not any(s.end == n_tokens and s.not_kept is None and s.error is None for s in saved):
        raise RuntimeError(f"the chain of {n_tokens} tokens was not stored whole: {saved}")
    return Stored(request=request, ends=ends, build_s=t1 - t0, save_s=t2 - t1)


def _one(rt: Runtime, stored: Stored) -> dict[str, Any]:
    result, report = rt.restore(stored.request.tokens, stored.ends)
    steps = dict(result.breakdown) if result is not None else {}
    return {
        "steps": steps,
        "restore_s": sum(steps.get(k, 0.0) for k in TIMED),
        "with_probe_s": sum(steps.get(k, 0.0) for k in (*TIMED, PROBE)),
        "reused": report.reused,
        "verified": bool(report.verified),
        "needed": int(llama_cpp.llama_state_seq_get_size(rt.session.ctx, 0)),
        "packed": bool(result is not None and result.packed),
    }


def _restores(model: Path, store: Path, stored: Stored, repeats: int) -> dict[str, Any]:
    n = len(stored.request.tokens)
    files = files_under(store)
    # the thread count a user gets (fitted to the free cores): the chain was made on one
    config = replace(session_config(model, n), n_threads=None)
    with Runtime(config, cache_dir=store) as rt:
        if rt.cache is not None:  # room for the chain's packed state beside it
            held = sum(p.stat().st_size for p in files)
            rt.cache.budget_bytes = max(rt.cache.store.default_budget(), BUDGET_SHARE * held)
        warm = [_one(rt, stored)]
        rt.work.wait()  # the chain packed, from its blocks, before the repeats
        os.sync()  # and on the disk: the kernel's writeback is not timed with the repeats
        warm += [_one(rt, stored) for _ in range(repeats)]
        rt.work.wait()  # nothing written while the files are listed and dropped
        unpacked = sum(not r["packed"] for r in warm[1:])
        if unpacked:  # the repeats are the packed state's figures: none may be the blocks'
            raise RuntimeError(f"{unpacked} of {repeats} warm restores read the blocks")
        llama_load = _llama_loads(rt, stored, repeats)
        files = files_under(store)  # with the packed state: dropped too
        dropped, drops = [], []
        for _ in range(repeats):
            rt.session.reset()
            before = cached_bytes()
            drop(files)
            drops.append(before - cached_bytes())
            dropped.append(_one(rt, stored))
        threads = rt.session.threads.current
        readers = rt.cache.store.readers if rt.cache is not None else 0
    return {
        "first": warm[0],
        "warm": warm[1:],
        "dropped": dropped,
        "dropped_bytes": drops,
        "llama_load": llama_load,
        "threads": threads,
        "readers": readers,
    }


def _llama_loads(rt: Runtime, stored: Stored, repeats: int) -> dict[str, float]:
    """llama.cpp's own load of the chain's packed stream (no lookup or probe),
    ``repeats`` times each (medians): from a new mapping of the file, as a restore maps
    it (its pages mapped as the load reads them), alone and with the stream's xxh3-128
    read at its own pace on another thread (how a restore read the checksum before it
    read it just ahead of the load: ``storage/packed.py``); and from one mapping whose
    pages are all mapped already, and how much of it the kernel mapped in huge pages.
    Empty where the chain was not packed."""
    if rt.cache is None:
        return {}
    tip = rt.cache.plan(stored.request.tokens, stored.ends).chain[-1]
    n = tip.end - 1
    tokens = [int(t) for t in stored.request.tokens[:n]]
    packed = rt.cache.store.packed

    def load(found: PackedState, *, digest: bool = False) -> float:
        rt.session.reset()
        beside = threading.Thread(target=xxhash.xxh3_128, args=(found.stream,))
        t0 = time.perf_counter()
        if digest:
            beside.start()
        rt.session.load_state(found.stream, tokens, named=True)
        if digest:
            beside.join()
        return time.perf_counter() - t0

    def opened() -> PackedState:
        found = packed.open(tip.hash, n)
        if found is None or isinstance(found, str):
            raise LookupError(f"packed state of {tip.hash} is gone")
        return found

    new: list[float] = []
    own_pace: list[float] = []
    try:
        for _ in range(repeats):
            for digest, seconds in ((False, new), (True, own_pace)):
                with contextlib.closing(opened()) as found:
                    seconds.append(load(found, digest=digest))
        with contextlib.closing(opened()) as found:
            load(found)  # maps every page
            huge = huge_mapped_bytes(found.stream.__array_interface__["data"][0])
            mapped = [load(found) for _ in range(repeats)]
    except LookupError:
        return {}
    finally:
        rt.session.reset()
    return {
        "new_s": statistics.median(new),
        "own_pace_digest_s": statistics.median(own_pace),
        "mapped_s": statistics.median(mapped),
        "huge_page_bytes": huge,
        "packed_bytes": rt.cache.store.packed.path(tip.hash).stat().st_size,
    }


def _floors(store: Path, needed: int, repeats: int) -> dict[str, Any]:
    files = [p for p in files_under(store) if not p.name.endswith(PACKED)]  # the blocks
    size = sum(p.stat().st_size for p in files)
    into = np.empty(size, dtype=np.uint8)
    into.fill(0)  # every page faulted in before the clock starts
    cold, warm = [], []
    for _ in range(repeats):
        drop(files)
        cold.append(read_seconds(files, into))
        warm.append(read_seconds(files, into))
    del into
    gc.collect()
    return {
        "file_bytes": size,
        "read_dropped_s": statistics.median(cold),
        "read_warm_s": statistics.median(warm),
        "memcpy_s": memcpy_seconds(needed, repeats),
    }


def _median_steps(runs: list[dict[str, Any]]) -> dict[str, float]:
    seen = {k for r in runs for k in r["steps"]}
    keys = [k for k in STEPS if k in seen] + sorted(seen - set(STEPS))
    out = {k: statistics.median(r["steps"].get(k, 0.0) for r in runs) for k in keys}
    out["restore_s"] = statistics.median(r["restore_s"] for r in runs)
    out["with_probe_s"] = statistics.median(r["with_probe_s"] for r in runs)
    return out


def measure_synthetic(model: Path, n: int, repeats: int, work: Path) -> dict[str, Any]:
    """Every figure of a synthetic chain of ``n`` bench tokens on ``model`` (see the module)."""
    store = work / f"synthetic-{n}"
    shutil.rmtree(store, ignore_errors=True)
    try:
        stored = store_synthetic(model, n, store)
        gc.collect()
        os.sync()  # the store on the disk before it is restored, as minutes after a save
        runs = _restores(model, store, stored, repeats)
        gc.collect()
        every = [runs["first"], *runs["warm"], *runs["dropped"]]
        needed = int(statistics.median(r["needed"] for r in every))
        floors = _floors(store, needed, repeats)
        disk = tree_bytes(store)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return {
        "tokens": len(stored.request.tokens),
        "reused": min(r["reused"] for r in every),
        "verified": all(r["verified"] for r in every),
        "needed": needed,
        "disk": disk,
        "build_s": stored.build_s,
        "save_s": stored.save_s,
        "first": _median_steps([runs["first"]]),
        "warm": _median_steps(runs["warm"]),
        "dropped": _median_steps(runs["dropped"]),
        "dropped_from_page_cache": min(runs["dropped_bytes"]),
        "threads": runs["threads"],
        "readers": runs["readers"],
        "llama_load": runs["llama_load"],
        **floors,
    }
