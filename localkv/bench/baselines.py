"""What ``localkv bench`` compares against: llama.cpp's own paths, and the floor.

- llama.cpp's sequence state files (``llama_state_seq_save_file`` /
  ``llama_state_seq_load_file``): save, load, bytes, and a first token from a
  file of N-1 tokens plus the last token decoded;
- llama-cpp-python's ``LlamaDiskCache`` with a high-level ``llama_cpp.Llama``;
- the physical floor: the raw state bytes read back from the page cache and
  handed to ``llama_state_seq_set_data``, with no checks and no decode.

Each is timed with ``stats``; the llama.cpp-file first token also from
storage (``disk.cold_call``, ``ColdStat``).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import xxhash

from localkv.bench.disk import cold_call
from localkv.bench.stats import ColdStat, Stat, timed
from localkv.model.native import llama_cpp
from localkv.model.session import ModelSession

__all__ = [
    "ColdStat",  # imported from here by the tests
    "DiskCacheBench",
    "DiskCacheResult",
    "FloorResult",
    "LlamaFileResult",
    "LlamaFiles",
    "Stat",  # imported from here by the tests
    "dir_bytes",
    "floor",
    "get_data",
]


# ----------------------------------------------------------- llama.cpp files
@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaFileResult:
    save: Stat  # llama_state_seq_save_file of N tokens
    load: Stat  # llama_state_seq_load_file of N tokens
    ttft: Stat  # load_file of N-1 tokens + decode the last token + argmax
    ttft_cold: ColdStat  # the same, the N-1 file evicted from the page cache before each run
    file_bytes: int
    first_tokens: tuple[int, ...]


class LlamaFiles:
    """llama.cpp's own sequence-state files of the session's current state (seq 0)."""

    def __init__(
        self,
        session: ModelSession,
        tokens: Sequence[int],
        work: Path,
        n: int,
        ends: Sequence[int] = (),
    ) -> None:
        self.session = session
        self.tokens = list(tokens)
        self.ends = [e for e in ends if e < n]  # the cold run's batch ends before the last token
        self.full = work / f"llama-seq-{n}.bin"
        self.head = work / f"llama-seq-{n}-minus-1.bin"
        self.save_times: list[float] = []

    def _save(self, path: Path, n: int) -> None:
        arr = (llama_cpp.llama_token * n)(*self.tokens[:n])
        written = llama_cpp.llama_state_seq_save_file(
            self.session.ctx, str(path).encode(), 0, arr, n
        )
        if not written:
            raise RuntimeError(f"llama_state_seq_save_file failed for {path}")

    def _load(self, path: Path, n: int) -> None:
        out = (llama_cpp.llama_token * n)()
        n_out = ctypes.c_size_t(0)
        read = llama_cpp.llama_state_seq_load_file(
            self.session.ctx, str(path).encode(), 0, out, n, ctypes.byref(n_out)
        )
        if not read or n_out.value != n:
            raise RuntimeError(f"llama_state_seq_load_file failed for {path}")

    def timed_load(self) -> float:
        """Seconds for one ``load_file`` of the N-token file into the emptied session."""
        self.session.reset()
        return timed(lambda: self._load(self.full, len(self.tokens)))

    def save_both(self, repeats: int) -> None:
        """Save the session's N tokens ``repeats`` times (timed), then N-1 tokens once.

        The session must hold exactly the N tokens; it holds N-1 afterwards. Memory
        that cannot be trimmed (an SWA window, a recurrent state) is emptied and the
        N-1 tokens prefilled in the cold run's batches (``ends``) instead.
        """
        n = len(self.tokens)
        if self.session.tokens != self.tokens:
            raise ValueError("the session does not hold the bench tokens")
        self.save_times = [timed(lambda: self._save(self.full, n)) for _ in range(repeats)]
        if self.session.memory_kind == "kv":
            self.session.truncate(n - 1)
        else:
            self.session.reset()
            self.session.prefill(self.tokens[: n - 1], ends=[*self.ends, n - 1])
        self._save(self.head, n - 1)

    def _ttft(self) -> tuple[float, int]:
        n = len(self.tokens)
        self.session.reset()
        t0 = time.perf_counter()
        self._load(self.head, n - 1)
        self.session.tokens = self.tokens[: n - 1]
        logits = self.session.decode_one(self.tokens[-1])
        first = int(np.argmax(logits))
        return time.perf_counter() - t0, first

    def measure(self, repeats: int) -> LlamaFileResult:
        if not self.save_times:
            raise RuntimeError("save_both first")
        loads = [self.timed_load() for _ in range(repeats)]
        ttfts = [self._ttft() for _ in range(repeats)]
        # after the page-cache runs, so those are not disturbed by the evictions
        colds = [cold_call([self.head], self._ttft) for _ in range(repeats)]
        self.session.reset()
        return LlamaFileResult(
            save=Stat.of(self.save_times),
            load=Stat.of(loads),
            ttft=Stat.of([t for t, _ in ttfts]),
            ttft_cold=ColdStat.of(
                [c.map(lambda ttft: ttft[0]) for c in colds], self.head.stat().st_size
            ),
            file_bytes=self.full.stat().st_size,
            first_tokens=tuple(f for _, f in ttfts) + tuple(c.value[1] for c in colds),
        )


# ------------------------------------------------------------ physical floor
def get_data(session: ModelSession, repeats: int) -> Stat:
    """``llama_state_seq_get_data`` of the session's sequence into a ready buffer."""
    size = int(llama_cpp.llama_state_seq_get_size(session.ctx, 0))
    buf = (ctypes.c_uint8 * size)()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        written = llama_cpp.llama_state_seq_get_data(session.ctx, buf, size, 0)
        times.append(time.perf_counter() - t0)
        if written != size:
            raise RuntimeError(f"state capture wrote {written} of {size} bytes")
    return Stat.of(times)


@dataclass(frozen=True, slots=True, kw_only=True)
class FloorResult:
    read_set: Stat  # readinto a ready buffer + llama_state_seq_set_data
    set_only: Stat  # llama_state_seq_set_data alone
    read_hash: Stat  # the chain's block files read into a ready buffer and hashed (xxh3-128)
    read_hash_placed: Stat  # the same, each file into a place of its own in one buffer


def read_and_hash(files: Sequence[Path], repeats: int, *, placed: bool = False) -> Stat:
    """The block files a restore reads, read from the page cache into a ready buffer and
    hashed with the store's xxh3-128 (a digest per file), one after another: what reading
    and checking the bytes costs.

    By default every file goes into the same buffer, which stays in the CPU's cache:
    nothing is placed anywhere. ``placed``: each file into a place of its own in one
    buffer as large as them all (allocated and touched beforehand), as a restore must put
    every byte where ``llama_state_seq_set_data``'s one contiguous buffer holds it, so
    each is written out to memory.
    """
    sizes = [f.stat().st_size for f in files]
    buf = np.empty(sum(sizes) if placed else max(sizes, default=0), dtype=np.uint8)

    def once() -> None:
        at = 0
        for path, size in zip(files, sizes, strict=True):
            place = buf.data[at : at + size]
            with path.open("rb", buffering=0) as f:
                if f.readinto(place) != size:
                    raise RuntimeError(f"short read of {path}")
            xxhash.xxh3_128(place).digest()
            at += size if placed else 0

    once()  # (its first pass touches every page of the buffer)
    return Stat.of([timed(once) for _ in range(repeats)])


def floor(
    session: ModelSession, raw_path: Path, repeats: int, block_files: Sequence[Path] = ()
) -> FloorResult:
    """Read the raw state file (page cache) into a ready buffer and set it.

    The buffer is allocated and filled once beforehand, so neither page faults
    on fresh memory nor a cold page cache are counted: this is the least a
    restore from a file can cost here. ``set_only`` times llama.cpp's part;
    ``read_hash`` reads and hashes the chain's ``block_files`` (``read_and_hash``), and
    ``read_hash_placed`` each into a place of its own.
    """
    size = raw_path.stat().st_size
    buf = np.empty(size, dtype=np.uint8)
    ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))

    def read() -> None:
        with raw_path.open("rb", buffering=0) as f:
            if f.readinto(buf.data) != size:
                raise RuntimeError(f"short read of {raw_path}")

    def set_data() -> None:
        if llama_cpp.llama_state_seq_set_data(session.ctx, ptr, size, 0) != size:
            raise RuntimeError(f"llama.cpp did not accept the {size} state bytes")

    def read_set() -> None:
        read()
        set_data()

    read()
    both, alone = [], []
    for _ in range(repeats):
        session.reset()
        both.append(timed(read_set))
        session.reset()
        alone.append(timed(set_data))
    session.reset()
    return FloorResult(
        read_set=Stat.of(both),
        set_only=Stat.of(alone),
        read_hash=read_and_hash(block_files, repeats),
        read_hash_placed=read_and_hash(block_files, repeats, placed=True),
    )


# ------------------------------------------------------------ LlamaDiskCache
@dataclass(frozen=True, slots=True, kw_only=True)
class DiskCacheResult:
    eval_s: float  # llama_cpp.Llama.eval of the N tokens (once)
    set: Stat  # cache[tokens] = llm.save_state()
    get_load: Stat  # state = cache[tokens]; llm.load_state(state)
    disk_bytes: int  # the cache directory after one set


class DiskCacheBench:
    """llama-cpp-python's high-level ``Llama`` (its defaults) and its ``LlamaDiskCache``."""

    def __init__(self, model_path: Path, n_ctx: int, n_threads: int) -> None:
        # Any: llama-cpp-python's high-level API is only partly annotated
        self.llm: Any = llama_cpp.Llama(
            model_path=str(model_path),
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            verbose=False,
        )

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> DiskCacheBench:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def measure(self, tokens: Sequence[int], directory: Path, repeats: int) -> DiskCacheResult:
        from llama_cpp.llama_cache import LlamaDiskCache

        llm = self.llm
        llm.reset()
        eval_s = timed(lambda: llm.eval(list(tokens)))
        cache = LlamaDiskCache(cache_dir=str(directory), capacity_bytes=1 << 40)
        sets, gets, sizes = [], [], []
        try:
            for _ in range(repeats):
                # LlamaDiskCache prints three lines to stderr on every set
                with contextlib.redirect_stderr(io.StringIO()):
                    t0 = time.perf_counter()
                    cache[tokens] = llm.save_state()
                    sets.append(time.perf_counter() - t0)
                sizes.append(dir_bytes(directory))
                t0 = time.perf_counter()
                state = cache[tokens]  # pops the entry: one get per set
                llm.load_state(state)
                gets.append(time.perf_counter() - t0)
        finally:
            cache.cache.close()
        return DiskCacheResult(
            eval_s=eval_s, set=Stat.of(sets), get_load=Stat.of(gets), disk_bytes=max(sizes)
        )


def dir_bytes(directory: Path) -> int:
    """Total size of the files under ``directory``."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
