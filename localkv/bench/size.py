"""Every measurement ``localkv bench`` takes for one prompt length N, on one session.

``bench_size`` runs them in order: the cold prefill, the save as blocks, warm
restores from the page cache and from storage, peak memory of a restore, the
baselines of ``benchbaselines``, ``Runtime.ask`` with the cache on and off, and
the block encodings of ``benchcodecs``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from localkv.bench import baselines as base
from localkv.bench import codecs as benchcodecs
from localkv.bench.disk import cold_call
from localkv.bench.results import RESTORE, STEPS, AskResult, BenchConfig, SizeResult
from localkv.bench.stats import ColdStat, PeakMemory, Stat, peak_memory, timed
from localkv.bench.text import bench_text
from localkv.cache.identity import Identity
from localkv.cache.prefix import PrefixCache
from localkv.model.sampling import SamplingParams
from localkv.model.session import ModelSession
from localkv.prompt.request import Document
from localkv.runtime import Runtime
from localkv.storage.store import Block, SnapshotStore

__all__ = ["QUESTION", "ProgressFn", "bench_size", "prompt_tokens"]

ProgressFn = Callable[[str], None]
QUESTION = "What did Alice see run close by her?"


def prompt_tokens(session: ModelSession, n: int) -> list[int]:
    """The bench text tokenized and cut to exactly ``n`` tokens."""
    chapters = 1
    while True:
        tokens = session.tokenize(bench_text(chapters))
        if len(tokens) >= n:
            return tokens[:n]
        chapters = max(chapters + 1, chapters * (n // max(1, len(tokens)) + 1))


def _first_token(session: ModelSession) -> int:
    logits = session.last_logits
    if logits is None:
        raise RuntimeError("no logits after the last token")
    return int(np.argmax(logits))


class _SizeBench:
    """The measurements of one prompt length on one session."""

    def __init__(
        self,
        cfg: BenchConfig,
        session: ModelSession,
        identity: Identity,
        work: Path,
        n: int,
        say: ProgressFn,
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

    def close(self) -> None:
        self.store.close()

    def cold(self) -> tuple[Stat, int]:
        times, first = [], -1
        for i in range(self.cfg.cold_repeats):
            self.say(f"  cold prefill of {self.n:,} tokens ({i + 1}/{self.cfg.cold_repeats})")
            self.session.reset()
            t0 = time.perf_counter()
            self.session.prefill(self.tokens, ends=self.ends)
            first = _first_token(self.session)
            times.append(time.perf_counter() - t0)
        return Stat.of(times), first

    def save(self, seconds_per_token: float) -> tuple[float, float, int, int]:
        t0 = time.perf_counter()
        blocks = self.cache.prepare(self.session, [self.n], seconds_per_token)
        t1 = time.perf_counter()
        saved = self.cache.write(blocks)
        t2 = time.perf_counter()
        if saved.tip is None:
            raise RuntimeError("nothing was saved")
        self.tip, self.blocks = saved.tip, blocks
        chain = self.store.chain_of(saved.tip)
        return t1 - t0, t2 - t1, len(chain), sum(r.stored_bytes for r in chain)

    def _restore_timed(self) -> tuple[float, dict[str, float], bool, int]:
        t0 = time.perf_counter()
        result = self.cache.restore(self.session, self.tokens, self.ends)
        first = _first_token(self.session) if result.reused == self.n else -1
        seconds = time.perf_counter() - t0
        return seconds, dict(result.breakdown), bool(result.verified), first

    def _run_deferred(self) -> None:
        for fn in self.deferred:
            fn()
        self.deferred.clear()

    def _restore_once(self) -> tuple[float, dict[str, float], bool, int]:
        self.session.reset()
        out = self._restore_timed()
        self._run_deferred()
        return out

    def block_files(self, tip: str) -> list[Path]:
        """The files of the stored chain ending at ``tip``."""
        return [self.store.root / row.file for row in self.store.chain_of(tip)]

    def warm(
        self, files: base.LlamaFiles, what: str = ""
    ) -> tuple[Stat, dict[str, Stat], bool, list[int], Stat]:
        """Warm restores from the page cache, each paired with a ``load_file`` just before it.

        The last value is each run's restore (without the probe) over the
        ``load_file`` timed right before it: both see the same machine state.
        """
        self.say(f"  warm restore of {self.n:,} tokens{what} x {self.cfg.repeats}")
        runs, loads = [], []
        for _ in range(self.cfg.repeats):
            loads.append(files.timed_load())
            runs.append(self._restore_once())
        steps = {s: Stat.of([r[1].get(s, 0.0) for r in runs]) for s in STEPS}
        # the state restored, before the probe decode: what llama.cpp's load_file does
        restores = [sum(r[1].get(s, 0.0) for s in STEPS[:3]) for r in runs]
        steps[RESTORE] = Stat.of(restores)
        paired = Stat.of([r / lf for r, lf in zip(restores, loads, strict=True)])
        verified = all(r[2] for r in runs)
        return Stat.of([r[0] for r in runs]), steps, verified, [r[3] for r in runs], paired

    def compact(
        self, files: base.LlamaFiles
    ) -> tuple[Stat, dict[str, Stat], bool, list[int], Stat, int]:
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
            return (*self.warm(files, ", compact blocks"), stored)
        finally:
            self.cache = plain
            store.close()

    def warm_evicted(self) -> tuple[ColdStat, bool, list[int]]:
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
        cold = ColdStat.of(
            [(r[0], read, ev) for r, read, ev in runs], sum(p.stat().st_size for p in files)
        )
        return cold, all(r[2] for r, _, _ in runs), [r[3] for r, _, _ in runs]

    def restore_memory(self) -> PeakMemory:
        self.session.reset()
        peak = peak_memory(lambda: self.cache.restore(self.session, self.tokens, self.ends))
        for fn in self.deferred:
            fn()
        self.deferred.clear()
        return peak


def _ask(cfg: BenchConfig, work: Path, n: int, say: ProgressFn) -> AskResult:
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


def bench_size(
    cfg: BenchConfig,
    session: ModelSession,
    identity: Identity,
    llm: base.DiskCacheBench,
    work: Path,
    n: int,
    say: ProgressFn,
) -> SizeResult:
    """Every per-length measurement for ``n`` tokens."""
    sb = _SizeBench(cfg, session, identity, work, n, say)
    try:
        cold, cold_first = sb.cold()
        get_data = base.get_data(session, cfg.repeats)
        raw = session.capture_state()
        raw_path = work / f"raw-{n}.bin"
        raw_path.write_bytes(raw)
        say(f"  saving {n:,} tokens as blocks")
        prepare_s, write_s, blocks, stored = sb.save(cold.median / n)
        files = base.LlamaFiles(session, sb.tokens, work, n)
        files.save_both(cfg.repeats)
        warm, steps, verified, warm_firsts, paired = sb.warm(files)
        warm_evicted, cold_verified, cold_firsts = sb.warm_evicted()
        compact = sb.compact(files)
        compact_warm, compact_steps, compact_verified, compact_firsts, compact_paired = compact[:5]
        compact_bytes = compact[5]
        memory = sb.restore_memory()
        say(f"  llama.cpp state files, physical floor, LlamaDiskCache ({n:,} tokens)")
        llama_file = files.measure(cfg.repeats)
        floor = base.floor(session, raw_path, cfg.repeats)
        disk_cache = llm.measure(sb.tokens, work / f"diskcache-{n}", cfg.repeats)
        ask = _ask(cfg, work, n, say)
        say(f"  block encodings of {n:,} tokens on {cfg.workers} thread(s)")
        # raw: captured after the cold prefill, while the session held exactly the N tokens
        encodings = benchcodecs.compare(
            raw,
            work / f"encodings-{n}",
            block_size=cfg.block_size,
            workers=cfg.workers,
            repeats=cfg.repeats,
        )
    finally:
        sb.close()
    firsts = {*warm_firsts, *cold_firsts, *compact_firsts, *llama_file.first_tokens}
    return SizeResult(
        tokens=n,
        cold_ttft=cold,
        warm_ttft=warm,
        warm_steps=steps,
        warm_over_load_file=paired,
        warm_evicted=warm_evicted,
        warm_verified=verified and cold_verified and compact_verified,
        first_token_agrees=firsts == {cold_first},
        save_prepare_s=prepare_s,
        save_write_s=write_s,
        blocks=blocks,
        stored_bytes=stored,
        raw_bytes=len(raw),
        compact_ttft=compact_warm,
        compact_steps=compact_steps,
        compact_over_load_file=compact_paired,
        compact_bytes=compact_bytes,
        get_data_s=get_data,
        floor=floor,
        llama_file=llama_file,
        disk_cache=disk_cache,
        ask=ask,
        restore_memory=memory,
        encodings=encodings,
    )
