"""What ``localkv bench`` is asked to do (``BenchConfig``) and what it found, as values.

``SizeResult`` holds every figure for one prompt length, ``BenchResult`` the
whole run; ``report`` writes them out and ``table`` prints them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from localkv.bench.baselines import DiskCacheResult, FloorResult, LlamaFileResult
from localkv.bench.codecs import EncodingResult
from localkv.bench.lookup import LookupResult
from localkv.bench.stats import ColdStat, PeakMemory, Stat
from localkv.model.session import SessionConfig

__all__ = [
    "COLUMNS",
    "RESTORE",
    "STEPS",
    "AskResult",
    "BenchConfig",
    "BenchResult",
    "SizeResult",
]

STEPS = ("lookup", "read", "load", "probe")
RESTORE = "restore"  # lookup + read + load: the state in place, not yet verified by the probe
# of the read step: V into llama.cpp's columns (flash attention off; on the reader threads,
# summed over them), from ``RestoreResult.breakdown``
COLUMNS = "columns"


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    model_path: Path
    sizes: tuple[int, ...] = (512, 2048, 8192)
    cold_repeats: int = 2  # full prefills: cold TTFT and each side of the ask comparison
    repeats: int = 5  # everything cheap: warm TTFT, llama.cpp files, disk cache, floor
    lookup_blocks: int = 10_000
    lookup_repeats: int = 200
    n_threads: int | None = None
    flash_attn: str = "auto"  # as ``SessionConfig.flash_attn``
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
        """Threads that decode the block encodings of ``codecs``."""
        return self.decode_workers or os.cpu_count() or 1

    @property
    def n_ctx(self) -> int:
        return max(self.sizes) + 64

    def session_config(self) -> SessionConfig:
        return SessionConfig(
            model_path=self.model_path,
            n_ctx=self.n_ctx,
            n_threads=self.n_threads,
            flash_attn=self.flash_attn,
            block_size=self.block_size,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class AskResult:
    """``Runtime.ask`` on a cold cache: first token with the cache on and off."""

    prompt_tokens: int
    ttft_cache_on: Stat
    ttft_cache_off: Stat
    return_cache_on: Stat  # ask() returned (answer done, blocks prepared)
    return_cache_off: Stat
    background_write: Stat  # waiting for the saver thread after ask() returned


@dataclass(frozen=True, slots=True, kw_only=True)
class SizeResult:
    tokens: int
    cold_ttft: Stat
    warm_ttft: Stat
    warm_steps: dict[str, Stat]
    # each run's restore (without the probe) over the load_file timed just before it
    warm_over_load_file: Stat
    warm_evicted: ColdStat  # warm TTFT, the chain's block files evicted before each run
    warm_verified: bool  # every restore, from the page cache or not
    first_token_agrees: bool  # warm and llama.cpp-file first tokens equal the cold one
    save_prepare_s: float
    save_write_s: float
    blocks: int
    stored_bytes: int
    partial_bytes: int  # of stored_bytes: the SWA windows / recurrent states kept with blocks
    raw_bytes: int
    compact_ttft: Stat  # warm TTFT from the same blocks written compact (``storage.planes``)
    compact_steps: dict[str, Stat]
    compact_over_load_file: Stat  # as warm_over_load_file, from the compact blocks
    compact_bytes: int
    # warm TTFT through the chain's packed state (``cache.restore.packed``), its steps, and
    # as warm_over_load_file; None for memory that is not plain KV (not packed)
    packed_ttft: Stat | None
    packed_steps: dict[str, Stat] | None
    packed_over_load_file: Stat | None
    get_data_s: Stat  # llama_state_seq_get_data into a ready buffer
    floor: FloorResult
    llama_file: LlamaFileResult
    disk_cache: DiskCacheResult
    ask: AskResult
    restore_memory: PeakMemory
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
            "restore_over_read_hash": self.warm_steps[RESTORE].median / self.floor.read_hash.median,
            "restore_over_placed_set": self.warm_steps[RESTORE].median
            / (self.floor.read_hash_placed.median + self.floor.set_only.median),
            "stored_over_raw": self.stored_bytes / self.raw_bytes,
            "compact_restore_over_load_file": self.compact_steps[RESTORE].median
            / self.llama_file.load.median,
            "compact_over_raw": self.compact_bytes / self.raw_bytes,
            "restore_over_load_file_paired": self.warm_over_load_file.median,
            "compact_restore_over_load_file_paired": self.compact_over_load_file.median,
            **self._packed_ratios(),
        }

    def _packed_ratios(self) -> dict[str, float]:
        if self.packed_steps is None or self.packed_over_load_file is None:
            return {}
        return {
            "packed_restore_over_load_file": self.packed_steps[RESTORE].median
            / self.llama_file.load.median,
            "packed_restore_over_read_hash": self.packed_steps[RESTORE].median
            / self.floor.read_hash.median,
            "packed_restore_over_load_file_paired": self.packed_over_load_file.median,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchResult:
    config: BenchConfig
    machine: dict[str, object]
    model: dict[str, object]
    sizes: list[SizeResult]
    lookup: LookupResult | None
    started: str
    seconds: float
    notes: list[str] = field(default_factory=list)
