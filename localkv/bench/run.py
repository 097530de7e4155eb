"""``localkv bench``: time to first token, cold and restored, against llama.cpp's own paths.

Headless measurements, all in one run, for each prompt length N (the bundled
public-domain text cut to exactly N tokens), on one model:

- **cold**: block-aligned prefill of N tokens plus the first (greedy) token;
- **warm**: the N tokens saved as blocks, then an emptied sequence, a verified
  restore (lookup, read, load, probe decode) and the first token; once with the
  block files in the page cache, once with them dropped from it before each
  run (``disk``: ``posix_fadvise``, checked by ``/proc/self/io``);
- the baselines of ``baselines``: llama.cpp's state files, llama-cpp-python's
  ``LlamaDiskCache``, and the physical floor (raw state bytes from the page cache
  into ``llama_state_seq_set_data``);
- bytes on disk against raw KV bytes, save time, ``Runtime.ask``'s first token
  with the cache on and off (the save runs after the answer), and peak memory
  during a restore;
- the block encodings of ``codecs`` on the N tokens' KV state: raw block
  files against the compressed ones rejected for the store (bytes on disk
  against decode time);

and once: the longest-prefix lookup with many blocks indexed (``lookup``).
``bench_size`` (``size``) takes the per-length measurements. The run also
records what it ran on: the machine (``describe_machine``: CPU, cores, memory,
GPU, versions) and the model (``describe_model``), and the load average before
and after, since other work on the machine scatters the timings. Everything
runs under a fresh temporary directory; ``LOCALKV_HOME`` is never touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from localkv.bench.baselines import DiskCacheBench
from localkv.bench.disk import EVICTION_AVAILABLE, IN_MEMORY_FILE_SYSTEMS, file_system
from localkv.bench.lookup import bench_lookup
from localkv.bench.results import COLUMNS, RESTORE, STEPS, BenchConfig, BenchResult, SizeResult
from localkv.bench.size import Say, bench_size
from localkv.bench.stats import ColdStat
from localkv.bench.text import prompt_tokens
from localkv.cache.identity import Identity, identity_of
from localkv.model.native import llama_cpp, llama_cpp_version
from localkv.model.session import ModelSession
from localkv.storage.filehash import FileHasher
from localkv.storage.formats import q6

# COLUMNS, RESTORE, STEPS and prompt_tokens are imported from here too (the tests)
__all__ = [
    "COLUMNS",
    "RESTORE",
    "STEPS",
    "BenchConfig",
    "BenchResult",
    "cold_stats",
    "compact_decoder",
    "describe_machine",
    "describe_model",
    "prompt_tokens",
    "run_bench",
]

log = logging.getLogger(__name__)


def run_bench(cfg: BenchConfig, say: Say = log.info, work_dir: Path | None = None) -> BenchResult:
    """Run every measurement; ``say`` gets one line per step (progress)."""
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_before = load_average()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="localkv-bench-", dir=work_dir) as tmp:
        work = Path(tmp)
        work_fs = file_system(work)
        with ModelSession(cfg.session_config()) as session:
            identity = identity_of(session, FileHasher())
            machine = describe_machine()
            model = describe_model(session, identity)
            results = []
            with DiskCacheBench(cfg.model_path, cfg.n_ctx, session.n_threads) as llm:
                for n in cfg.sizes:
                    say(f"{n:,} tokens")
                    results.append(bench_size(cfg, session, identity, llm, work, n=n, say=say))
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
        f"Load average (1 min) {load_before} at the start, {load_average()} at the end, "
        f"on {os.cpu_count()} cores: other work on the machine slows and scatters timings.",
    ]
    return BenchResult(
        config=cfg,
        machine=machine,
        model=model,
        sizes=results,
        lookup=lookup,
        started=started,
        seconds=time.perf_counter() - t0,
        notes=notes,
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


# ------------------------------------------------------------------ machine
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    """The 1-minute load average, or ``unknown``."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


def total_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def gpu_description() -> str:
    """GPU names (from ``nvidia-smi`` where present) and whether llama.cpp can offload."""
    build = "GPU offload" if llama_cpp.llama_supports_gpu_offload() else "CPU only"
    names: list[str] = []
    smi = shutil.which("nvidia-smi")
    if smi:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [smi, "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
            names = [line.strip() for line in out.splitlines() if line.strip()]
    return f"{', '.join(names) or 'none'} (llama.cpp build: {build})"


def describe_machine() -> dict[str, object]:
    """Cores, memory, CPU model, GPU (or none) and library versions."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 0,
        "memory_bytes": total_memory(),
        "gpu": gpu_description(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp_version(),
        "gpu_offload_build": bool(llama_cpp.llama_supports_gpu_offload()),
        "compact_decoder": compact_decoder(),
    }


def compact_decoder() -> str:
    """What decodes compact block files here: AVX2, plain C, or numpy (not built)."""
    if q6.simd():
        return "compiled, AVX2"
    return "compiled, no AVX2" if q6.compiled() else "numpy (extension not built)"
