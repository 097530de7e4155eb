"""Every measurement ``localkv bench`` takes for one prompt length N, on one session.

``bench_size`` runs them in order, one named step each: the cold prefill, the
save as blocks, the verified restores (``_restores``: from the page cache, from
storage, from compact blocks, and the peak memory of one), the baselines of
``baselines`` (``_baselines``), ``Runtime.ask`` with the cache on and off
(``_ask``), and the block encodings of ``codecs`` (``_encodings``); then
``_size_result`` gathers them into one ``SizeResult``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from localkv.bench import baselines as base
from localkv.bench import codecs as benchcodecs
from localkv.bench.disk import cold_call, unread_bytes
from localkv.bench.results import COLUMNS, RESTORE, STEPS, AskResult, BenchConfig, SizeResult
from localkv.bench.stats import ColdStat, PeakMemory, Stat, peak_memory, timed
from localkv.bench.text import prompt_tokens
from localkv.cache.identity import Identity
from localkv.cache.prefix import PrefixCache
from localkv.kv import partial
from localkv.kv.blocks import end_state_bytes
from localkv.kv.partial import MemoryKind
from localkv.model.sampling import SamplingParams
from localkv.model.session import ModelSession
from localkv.prompt.request import Document
from localkv.runtime import Runtime
from localkv.storage import Block, SnapshotStore

__all__ = ["QUESTION", "Say", "bench_size"]

Say = Callable[[str], None]  # tells the user a line of the run's progress (``log.info``)
QUESTION = "What did Alice see run close by her?"


def first_token(session: ModelSession) -> int:
    """The greedy token after the session's last logits."""
    logits = session.last_logits
    if logits is None:
        raise RuntimeError("no logits after the last token")
    return int(np.argmax(logits))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Saved:
    """The N tokens saved as blocks: the two save steps and the chain on disk."""

    prepare_s: float
    write_s: float
    blocks: int
    stored_bytes: int
    partial_bytes: int  # of stored_bytes: the SWA windows / recurrent states (``kv.partial``)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Restored:
    """One restore of the saved chain, timed through its first token."""

    seconds: float
    steps: dict[str, float]  # the restore's breakdown (``STEPS``)
    verified: bool
    first: int  # the first token decoded after it; -1 when the restore fell short


@dataclass(frozen=True, slots=True, kw_only=True)
class _Warm:
    """Warm restores of one saved chain from the page cache."""

    ttft: Stat
    steps: dict[str, Stat]  # STEPS and RESTORE (lookup + read + load)
    over_load_file: Stat  # each run's restore over the load_file timed just before it
    verified: bool
    firsts: list[int]


class _Evicted(NamedTuple):
    """Warm restores with the chain's block files evicted from the page cache first."""

    cold: ColdStat
    verified: bool
    firsts: list[int]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Restores:
    """Every verified restore of one length: plain blocks, evicted, compact; peak memory."""

    warm: _Warm
    evicted: _Evicted
    compact: _Warm
    compact_bytes: int
    packed: _Warm | None  # None: the memory restores otherwise (``cache.restore.packed``)
    memory: PeakMemory

    @property
    def verified(self) -> bool:
        done = [w for w in (self.warm, self.compact, self.packed) if w is not None]
        return self.evicted.verified and all(w.verified for w in done)

    @property
    def firsts(self) -> set[int]:
        packed = self.packed.firsts if self.packed is not None else []
        return {*self.warm.firsts, *self.evicted.firsts, *self.compact.firsts, *packed}


class _Baselines(NamedTuple):
    llama_file: base.LlamaFileResult
    floor: base.FloorResult
    disk_cache: base.DiskCacheResult


class _SizeBench:
    """The measurements of one prompt length on one session."""

    def __init__(
        self,
        cfg: BenchConfig,
        session: ModelSession,
        identity: Identity,
        work: Path,
        n: int,
        *,
        say: Say,
    ) -> None:
        self.cfg, self.session, self.work, self.n, self.say = cfg, session, work, n, say
        self.tokens = prompt_tokens(session, n)
        self.ends = session.schedule(n, [n])
        self.store = SnapshotStore.open(work / f"store-{n}")
        self.deferred: list[Callable[[], None]] = []
        self.tip: str | None = None  # the saved chain's last block
        self.blocks: list[Block] = []  # the saved chain's blocks
        self.cache = PrefixCache(
            self.store, identity, "bench", cfg.block_size, defer=self.deferred.append
        )
        self.cache.packing = False  # the blocks' restores; ``packed`` turns it on

    def close(self) -> None:
        self.store.close()

    def cold(self) -> tuple[Stat, int]:
        times, first = [], -1
        for i in range(self.cfg.cold_repeats):
            self.say(f"  cold prefill of {self.n:,} tokens ({i + 1}/{self.cfg.cold_repeats})")
            self.session.reset()
            t0 = time.perf_counter()
            self.session.prefill(self.tokens, ends=self.ends)
            first = first_token(self.session)
            times.append(time.perf_counter() - t0)
        return Stat.of(times), first

    def save(self, seconds_per_token: float) -> _Saved:
        self.say(f"  saving {self.n:,} tokens as blocks")
        t0 = time.perf_counter()
        blocks = self.cache.prepare(self.session, [self.n], seconds_per_token)
        t1 = time.perf_counter()
        saved = self.cache.write(blocks)
        t2 = time.perf_counter()
        if saved.tip is None:
            raise RuntimeError("nothing was saved")
        self.tip, self.blocks = saved.tip, blocks
        chain = self.store.chain_of(saved.tip)
        partial = sum(
            end_state_bytes(b.meta, {k: a.nbytes for k, a in b.tensors.items()}) for b in blocks
        )
        return _Saved(
            prepare_s=t1 - t0,
            write_s=t2 - t1,
            blocks=len(chain),
            stored_bytes=sum(r.stored_bytes for r in chain),
            partial_bytes=partial,
        )

    def _restore_timed(self) -> _Restored:
        t0 = time.perf_counter()
        result = self.cache.restore(self.session, self.tokens, self.ends)
        first = first_token(self.session) if result.reused == self.n else -1
        seconds = time.perf_counter() - t0
        return _Restored(
            seconds=seconds,
            steps=dict(result.breakdown),
            verified=bool(result.verified),
            first=first,
        )

    def _run_deferred(self) -> None:
        for fn in self.deferred:
            fn()
        self.deferred.clear()

    def _restore_once(self) -> _Restored:
        self.session.reset()
        out = self._restore_timed()
        self._run_deferred()
        return out

    def block_files(self, tip: str) -> list[Path]:
        """The files of the stored chain ending at ``tip``."""
        return [self.store.root / row.file for row in self.store.chain_of(tip)]

    def warm(self, files: base.LlamaFiles, what: str = "") -> _Warm:
        """Warm restores from the page cache, each paired with a ``load_file`` just before it.

        ``over_load_file`` is each run's restore (without the probe) over the
        ``load_file`` timed right before it: both see the same machine state.
        """
        self.say(f"  warm restore of {self.n:,} tokens{what} x {self.cfg.repeats}")
        runs, loads = [], []
        for _ in range(self.cfg.repeats):
            loads.append(files.timed_load())
            runs.append(self._restore_once())
        steps = {s: Stat.of([r.steps.get(s, 0.0) for r in runs]) for s in (*STEPS, COLUMNS)}
        # the state restored, before the probe decode: what llama.cpp's load_file does
        restores = [sum(r.steps.get(s, 0.0) for s in STEPS[:3]) for r in runs]
        steps[RESTORE] = Stat.of(restores)
        paired = Stat.of([r / lf for r, lf in zip(restores, loads, strict=True)])
        verified = all(r.verified for r in runs)
        return _Warm(
            ttft=Stat.of([r.seconds for r in runs]),
            steps=steps,
            over_load_file=paired,
            verified=verified,
            firsts=[r.first for r in runs],
        )

    def compact(self, files: base.LlamaFiles) -> tuple[_Warm, int]:
        """``warm`` from a second store holding the same blocks in the compact format.

        Returns ``warm``'s figures and the compact chain's bytes on disk.
        """
        store = SnapshotStore.open(self.work / f"store-{self.n}-compact", compact=True)
        plain = self.cache
        try:
            self.cache = PrefixCache(
                store, plain.identity, "bench", self.cfg.block_size, defer=self.deferred.append
            )
            saved = self.cache.write(self.blocks)
            if saved.tip is None:
                raise RuntimeError("nothing was saved")
            stored = sum(r.stored_bytes for r in store.chain_of(saved.tip))
            return self.warm(files, ", compact blocks"), stored
        finally:
            self.cache = plain
            store.close()

    def packed(self, files: base.LlamaFiles) -> _Warm | None:
        """``warm`` through the chain's packed state (``cache.restore.packed``), packed by
        one restore from its blocks first; None for memory that is not plain KV (its
        chains are not packed)."""
        if self.session.memory_kind != "kv":
            return None
        self.cache.packing = True
        try:
            self._restore_once()
            if self.tip is None or not self.store.packed.listing():
                raise RuntimeError("the chain was not packed")
            return self.warm(files, ", packed state")
        finally:
            self.cache.packing = False

    def warm_evicted(self) -> _Evicted:
        """The warm restore with every block file of the chain evicted before each run."""
        if self.tip is None:
            raise RuntimeError("save first")
        files = self.block_files(self.tip)
        self.say(f"  warm restore of {self.n:,} tokens, block files evicted, x {self.cfg.repeats}")
        runs = []
        for _ in range(self.cfg.repeats):
            self.session.reset()
            runs.append(cold_call(files, self._restore_timed))
            self._run_deferred()
        unread = unread_bytes(self.blocks)
        on_disk = sum(p.stat().st_size for p in files)
        cold = ColdStat.of([r.map(lambda x: x.seconds) for r in runs], on_disk, on_disk - unread)
        return _Evicted(cold, all(r.value.verified for r in runs), [r.value.first for r in runs])

    def restore_memory(self) -> PeakMemory:
        self.session.reset()
        peak = peak_memory(lambda: self.cache.restore(self.session, self.tokens, self.ends))
        self._run_deferred()
        return peak


def _restores(sb: _SizeBench, files: base.LlamaFiles) -> _Restores:
    """The verified restores, in order: page cache, evicted first, compact blocks, the
    packed state, memory."""
    warm = sb.warm(files)
    evicted = sb.warm_evicted()
    compact, compact_bytes = sb.compact(files)
    packed = sb.packed(files)
    return _Restores(
        warm=warm,
        evicted=evicted,
        compact=compact,
        compact_bytes=compact_bytes,
        packed=packed,
        memory=sb.restore_memory(),
    )


def _baselines(
    sb: _SizeBench, files: base.LlamaFiles, llm: base.DiskCacheBench, raw_path: Path
) -> _Baselines:
    """llama.cpp's state files, the physical floor and ``LlamaDiskCache`` on the same tokens."""
    cfg, n = sb.cfg, sb.n
    sb.say(f"  llama.cpp state files, physical floor, LlamaDiskCache ({n:,} tokens)")
    llama_file = files.measure(cfg.repeats)
    if sb.tip is None:
        raise RuntimeError("the floor reads the saved chain's files: nothing was saved")
    floor = base.floor(sb.session, raw_path, cfg.repeats, sb.block_files(sb.tip))
    disk_cache = llm.measure(sb.tokens, sb.work / f"diskcache-{n}", cfg.repeats)
    return _Baselines(llama_file, floor, disk_cache)


def _ask(cfg: BenchConfig, work: Path, n: int, say: Say) -> AskResult:
    """``Runtime.ask`` on a cold cache with the cache on and off, alternating."""
    params = SamplingParams(temperature=0, max_tokens=4)
    on: list[tuple[float, float, float]] = []
    off: list[tuple[float, float, float]] = []
    prompt = 0
    for i in range(cfg.cold_repeats):
        for use_cache, out in ((True, on), (False, off)):
            say(f"  ask, cache {'on' if use_cache else 'off'} ({i + 1}/{cfg.cold_repeats})")
            cache_dir = work / f"ask-{n}-{i}"
            with Runtime(cfg.session_config(), cache_dir=cache_dir, use_cache=use_cache) as rt:
                doc = _document(rt, n)
                t0 = time.perf_counter()
                answer = rt.ask([doc], QUESTION, params=params)
                returned = time.perf_counter() - t0
                out.append((answer.timing.ttft_s, returned, timed(rt.wait_for_saves)))
                prompt = answer.tokens.prompt
    return AskResult(
        prompt_tokens=prompt,
        ttft_cache_on=Stat.of([r[0] for r in on]),
        ttft_cache_off=Stat.of([r[0] for r in off]),
        return_cache_on=Stat.of([r[1] for r in on]),
        return_cache_off=Stat.of([r[1] for r in off]),
        background_write=Stat.of([r[2] for r in on]),
    )


def _document(rt: Runtime, n: int) -> Document:
    """A document whose ask request (template, question) comes to about ``n`` tokens."""
    overhead = len(rt.build([Document.from_text("x")], system=None, question=QUESTION).tokens)
    body = prompt_tokens(rt.session, max(1, n - overhead))
    return Document.from_text(rt.session.detokenize(body), "bench.txt")


def _encodings(
    cfg: BenchConfig, raw: bytes, work: Path, n: int, say: Say, *, kind: MemoryKind | None
) -> list[benchcodecs.EncodingResult]:
    """The block encodings of the state ``raw`` (``llama_state_seq_get_data`` of N tokens):
    its attention part (the rows blocks hold; a partial part is stored as it is)."""
    if kind == "recurrent":  # no attention rows to encode
        return []
    say(f"  block encodings of {n:,} tokens on {cfg.workers} thread(s)")
    return benchcodecs.compare(
        bytes(partial.split(raw, kind)[0]) if kind in ("swa", "hybrid") else raw,
        work / f"encodings-{n}",
        block_size=cfg.block_size,
        workers=cfg.workers,
        repeats=cfg.repeats,
    )


def bench_size(  # noqa: PLR0913 - to take a value type
    cfg: BenchConfig,
    session: ModelSession,
    identity: Identity,
    llm: base.DiskCacheBench,
    work: Path,
    *,
    n: int,
    say: Say,
) -> SizeResult:
    """Every per-length measurement for ``n`` tokens, in the order the module names them."""
    sb = _SizeBench(cfg, session, identity, work, n, say=say)
    try:
        cold, cold_first = sb.cold()
        get_data = base.get_data(session, cfg.repeats)
        # captured after the cold prefill, while the session holds exactly the N tokens:
        # the floor reads it back from a file, the encodings encode it
        raw = session.capture_state()
        raw_path = work / f"raw-{n}.bin"
        raw_path.write_bytes(raw)
        saved = sb.save(cold.median / n)
        files = base.LlamaFiles(session, sb.tokens, work, n, sb.ends)
        files.save_both(cfg.repeats)
        restores = _restores(sb, files)
        baselines = _baselines(sb, files, llm, raw_path)
        ask = _ask(cfg, work, n, say)
        encodings = _encodings(cfg, raw, work, n, say, kind=session.memory_kind)
    finally:
        sb.close()
    firsts = restores.firsts | set(baselines.llama_file.first_tokens)
    return _size_result(
        n,
        cold,
        get_data,
        len(raw),
        saved,
        restores=restores,
        baselines=baselines,
        ask=ask,
        encodings=encodings,
        first_token_agrees=firsts == {cold_first},
    )


def _size_result(  # noqa: PLR0913 - to take a value type
    n: int,
    cold: Stat,
    get_data: Stat,
    raw_bytes: int,
    saved: _Saved,
    *,
    restores: _Restores,
    baselines: _Baselines,
    ask: AskResult,
    encodings: list[benchcodecs.EncodingResult],
    first_token_agrees: bool,
) -> SizeResult:
    """The steps' figures as one ``SizeResult``."""
    warm, compact = restores.warm, restores.compact
    return SizeResult(
        tokens=n,
        cold_ttft=cold,
        warm_ttft=warm.ttft,
        warm_steps=warm.steps,
        warm_over_load_file=warm.over_load_file,
        warm_evicted=restores.evicted.cold,
        warm_verified=restores.verified,
        first_token_agrees=first_token_agrees,
        save_prepare_s=saved.prepare_s,
        save_write_s=saved.write_s,
        blocks=saved.blocks,
        stored_bytes=saved.stored_bytes,
        partial_bytes=saved.partial_bytes,
        raw_bytes=raw_bytes,
        compact_ttft=compact.ttft,
        compact_steps=compact.steps,
        compact_over_load_file=compact.over_load_file,
        compact_bytes=restores.compact_bytes,
        packed_ttft=restores.packed.ttft if restores.packed else None,
        packed_steps=restores.packed.steps if restores.packed else None,
        packed_over_load_file=restores.packed.over_load_file if restores.packed else None,
        get_data_s=get_data,
        floor=baselines.floor,
        llama_file=baselines.llama_file,
        disk_cache=baselines.disk_cache,
        ask=ask,
        restore_memory=restores.memory,
        encodings=encodings,
    )
