"""``localkv bench``: time to first token, cold and restored, against llama.cpp's own paths.

Headless measurements, all in one run, for each prompt length N (the bundled
public-domain text cut to exactly N tokens), on one model:

- **cold**: block-aligned prefill of N tokens plus the first (greedy) token;
- **warm**: the N tokens saved as blocks, then an emptied sequence, a verified
  restore (lookup, read, load, probe decode) and the first token; once with the
  block files in the page cache, once with them dropped from it before each
  run (``benchdisk``: ``posix_fadvise``, checked by ``/proc/self/io``);
- the baselines of ``benchbaselines``: llama.cpp's state files, llama-cpp-python's
  ``LlamaDiskCache``, and the physical floor (raw state bytes from the page cache
  into ``llama_state_seq_set_data``);
- bytes on disk against raw KV bytes, save time, ``Runtime.ask``'s first token
  with the cache on and off (the save runs after the answer), and peak memory
  during a restore;
- the block encodings of ``benchcodecs`` on the N tokens' KV state: raw block
  files against the compressed ones rejected for the store (bytes on disk
  against decode time);

and once: the longest-prefix lookup with many blocks indexed. Everything runs
under a fresh temporary directory; ``LOCALKV_HOME`` is never touched.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localkv import benchbaselines as base
from localkv import benchcodecs
from localkv.benchbaselines import ColdStat, Stat, timed
from localkv.benchcodecs import EncodingResult
from localkv.benchdisk import EVICTION_AVAILABLE, IN_MEMORY_FILE_SYSTEMS, cold_call, file_system
from localkv.benchlookup import LookupResult, bench_lookup
from localkv.benchtext import bench_text
from localkv.cache import PrefixCache
from localkv.identity import Identity, identity_of
from localkv.request import Document
from localkv.runtime import Runtime
from localkv.sampling import SamplingParams
from localkv.session import ModelSession, SessionConfig
from localkv.storage.filehash import FileHasher
from localkv.storage.store import SnapshotStore

__all__ = [
    "AskResult",
    "BenchConfig",
    "BenchResult",
    "ColdStat",
    "EncodingResult",
    "LookupResult",
    "SizeResult",
    "Stat",
    "describe_model",
    "prompt_tokens",
    "run_bench",
]

log = logging.getLogger(__name__)

ProgressFn = Callable[[str], None]
STEPS = ("lookup", "read", "load", "probe")
RESTORE = "restore"  # lookup + read + load: the state in place, not yet verified by the probe
QUESTION = "What did Alice see run close by her?"


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model_path: Path
    sizes: tuple[int, ...] = (512, 2048, 8192)
    cold_repeats: int = 2  # full prefills: cold TTFT and each side of the ask comparison
    repeats: int = 5  # everything cheap: warm TTFT, llama.cpp files, disk cache, floor
    lookup_blocks: int = 10_000
    lookup_repeats: int = 200
    n_threads: int | None = None
    block_size: int = 256
    decode_workers: int | None = None  # threads decoding block encodings; None: every core

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 2:
            raise ValueError(f"sizes must be at least 2 tokens each, got {self.sizes}")
        if len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"sizes must differ, got {self.sizes}")
        for name in ("cold_repeats", "repeats", "lookup_repeats", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lookup_blocks < 0:
            raise ValueError(f"lookup_blocks must be >= 0, got {self.lookup_blocks}")
        if self.decode_workers is not None and self.decode_workers < 1:
            raise ValueError(f"decode_workers must be positive, got {self.decode_workers}")

    @property
    def workers(self) -> int:
        """Threads that decode the block encodings of ``benchcodecs``."""
        return self.decode_workers or os.cpu_count() or 1

    @property
    def n_ctx(self) -> int:
        return max(self.sizes) + 64

    def session_config(self) -> SessionConfig:
        return SessionConfig(
            model_path=self.model_path,
            n_ctx=self.n_ctx,
            n_threads=self.n_threads,
            block_size=self.block_size,
        )


@dataclass(frozen=True, slots=True)
class AskResult:
    """``Runtime.ask`` on a cold cache: first token with the cache on and off."""

    prompt_tokens: int
    ttft_cache_on: Stat
    ttft_cache_off: Stat
    return_cache_on: Stat  # ask() returned (answer done, blocks prepared)
    return_cache_off: Stat
    background_write: Stat  # waiting for the saver thread after ask() returned


@dataclass(frozen=True, slots=True)
class SizeResult:
    tokens: int
    cold_ttft: Stat
    warm_ttft: Stat
    warm_steps: dict[str, Stat]
    warm_evicted: ColdStat  # warm TTFT, the chain's block files evicted before each run
    warm_verified: bool  # every restore, from the page cache or not
    first_token_agrees: bool  # warm and llama.cpp-file first tokens equal the cold one
    save_prepare_s: float
    save_write_s: float
    blocks: int
    stored_bytes: int
    raw_bytes: int
    get_data_s: Stat  # llama_state_seq_get_data into a ready buffer
    floor: base.FloorResult
    llama_file: base.LlamaFileResult
    disk_cache: base.DiskCacheResult
    ask: AskResult
    restore_memory: base.PeakMemory
    encodings: list[EncodingResult]  # raw and compressed block files of the same state

    @property
    def ratios(self) -> dict[str, float]:
        warm = self.warm_ttft.median
        return {
            "cold_over_warm": self.cold_ttft.median / warm,
            "warm_over_llama_file_ttft": warm / self.llama_file.ttft.median,
            "restore_over_load_file": self.warm_steps[RESTORE].median / self.llama_file.load.median,
            "restore_over_floor": self.warm_steps[RESTORE].median / self.floor.read_set.median,
            "warm_over_floor": warm / self.floor.read_set.median,
            "stored_over_raw": self.stored_bytes / self.raw_bytes,
        }


@dataclass(frozen=True, slots=True)
class BenchResult:
    config: BenchConfig
    machine: dict[str, object]
    model: dict[str, object]
    sizes: list[SizeResult]
    lookup: LookupResult | None
    started: str
    seconds: float
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------- helpers
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


# ------------------------------------------------------------- one size
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
        self.store = SnapshotStore.open(work / f"store-{n}")
        self.deferred: list[Callable[[], None]] = []
        self.tip: str | None = None  # the saved chain's last block
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
            self.session.prefill(self.tokens, boundaries=[self.n])
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
        self.tip = saved.tip
        chain = self.store.chain_of(saved.tip)
        return t1 - t0, t2 - t1, len(chain), sum(r.stored_bytes for r in chain)

    def _restore_timed(self) -> tuple[float, dict[str, float], bool, int]:
        t0 = time.perf_counter()
        result = self.cache.restore(self.session, self.tokens)
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

    def warm(self) -> tuple[Stat, dict[str, Stat], bool, list[int]]:
        self.say(f"  warm restore of {self.n:,} tokens x {self.cfg.repeats}")
        runs = [self._restore_once() for _ in range(self.cfg.repeats)]
        steps = {s: Stat.of([r[1].get(s, 0.0) for r in runs]) for s in STEPS}
        # the state restored, before the probe decode: what llama.cpp's load_file does
        steps[RESTORE] = Stat.of([sum(r[1].get(s, 0.0) for s in STEPS[:3]) for r in runs])
        verified = all(r[2] for r in runs)
        return Stat.of([r[0] for r in runs]), steps, verified, [r[3] for r in runs]

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

    def restore_memory(self) -> base.PeakMemory:
        self.session.reset()
        peak = base.peak_memory(lambda: self.cache.restore(self.session, self.tokens))
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
        warm, steps, verified, warm_firsts = sb.warm()
        warm_evicted, cold_verified, cold_firsts = sb.warm_evicted()
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
    firsts = {*warm_firsts, *cold_firsts, *llama_file.first_tokens}
    return SizeResult(
        tokens=n,
        cold_ttft=cold,
        warm_ttft=warm,
        warm_steps=steps,
        warm_evicted=warm_evicted,
        warm_verified=verified and cold_verified,
        first_token_agrees=firsts == {cold_first},
        save_prepare_s=prepare_s,
        save_write_s=write_s,
        blocks=blocks,
        stored_bytes=stored,
        raw_bytes=len(raw),
        get_data_s=get_data,
        floor=floor,
        llama_file=llama_file,
        disk_cache=disk_cache,
        ask=ask,
        restore_memory=memory,
        encodings=encodings,
    )


# -------------------------------------------------------------------- run
def run_bench(
    cfg: BenchConfig, say: ProgressFn = log.info, work_dir: Path | None = None
) -> BenchResult:
    """Run every measurement; ``say`` gets one line per step (progress)."""
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_before = base.load_average()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="localkv-bench-", dir=work_dir) as tmp:
        work = Path(tmp)
        work_fs = file_system(work)
        with ModelSession(cfg.session_config()) as session:
            identity = identity_of(session, FileHasher())
            machine = base.describe_machine()
            model = describe_model(session, identity)
            results = []
            with base.DiskCacheBench(cfg.model_path, cfg.n_ctx, session.n_threads) as llm:
                for n in cfg.sizes:
                    say(f"{n:,} tokens")
                    results.append(bench_size(cfg, session, identity, llm, work, n, say))
        lookup = None
        if cfg.lookup_blocks:
            lookup = bench_lookup(
                identity,
                work,
                blocks=cfg.lookup_blocks,
                repeats=cfg.lookup_repeats,
                block_size=cfg.block_size,
                request_tokens=max(cfg.sizes),
                say=say,
            )
    notes = [
        *_page_cache_notes(results, work_fs),
        "LlamaDiskCache pops an entry when it is read: its get is measured once per set.",
        f"Load average (1 min) {load_before} at the start, {base.load_average()} at the end, "
        f"on {os.cpu_count()} cores: other work on the machine slows and scatters timings.",
    ]
    return BenchResult(
        cfg, machine, model, results, lookup, started, time.perf_counter() - t0, notes
    )


def cold_stats(s: SizeResult) -> list[tuple[str, ColdStat]]:
    """Every measurement of ``s`` taken with its files evicted from the page cache."""
    out = [("warm TTFT", s.warm_evicted), ("llama.cpp-file TTFT", s.llama_file.ttft_cold)]
    out += [(f"encoding {e.name}", e.decode_cold) for e in s.encodings if e.decode_cold]
    return out


def _page_cache_notes(results: list[SizeResult], work_fs: str | None) -> list[str]:
    """What the page-cache rows read from, and whether every eviction was verified."""
    warm = (
        "Rows not marked otherwise read files just written, so from the page cache; a "
        "first restore after a reboot also pays the read from storage, which the rows "
        'marked "not in page cache" or "from disk" measure.'
    )
    if not EVICTION_AVAILABLE:
        return [
            warm,
            "posix_fadvise is not available here: no file could be dropped from "
            'the page cache, so every "not in page cache" cell says so instead of a time.',
        ]
    failed = [
        f"{label} at {s.tokens:,} tokens: {c.why_not_cold}"
        for s in results
        for label, c in cold_stats(s)
        if not c.dropped
    ]
    if not failed:
        return [
            warm,
            'Every "not in page cache" / "from disk" run was verified cold: after the '
            "eviction, /proc/self/io read_bytes grew by at least half the evicted files' "
            "bytes (see the read row and the encoding cells). On a virtual machine storage is "
            "the virtual disk, which the host may still cache.",
        ]
    hint = ""
    if work_fs in IN_MEMORY_FILE_SYSTEMS:
        hint = (
            f" The work directory is on {work_fs}, whose files live only in the page cache: "
            "set TMPDIR to a directory on a disk."
        )
    return [
        warm,
        'Some evictions did not take (cells say "page cache not dropped" instead of a '
        "time): " + "; ".join(failed) + "." + hint,
    ]


def describe_model(session: ModelSession, identity: Identity) -> dict[str, object]:
    """Name, file size, KV types and context settings of the benchmarked model.

    ``flash_attn`` shows the setting and what llama.cpp chose (seen in the KV layout).
    """
    cfg = session.config
    path = Path(cfg.model_path)
    return {
        "name": session.meta("general.name") or path.stem,
        "description": session.describe(),
        "path": str(path),
        "file_bytes": path.stat().st_size,
        "type_k": cfg.type_k,
        "type_v": cfg.type_v,
        "flash_attn": f"{session.flash_attn_setting()} "
        f"(llama.cpp: {'on' if identity.flash_attn else 'off'})",
        "n_ctx": session.n_ctx,
        "n_batch": session.n_batch,
        "n_threads": session.n_threads,
        "block_size": cfg.block_size,
    }
