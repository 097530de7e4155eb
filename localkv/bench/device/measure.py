"""One build, one process: the cold prefill, a verified restore and the first token after it.

``python -m localkv.bench.device.measure --sizes 2048,8192 --out FILE`` loads the
model once, every layer on the device the loaded build offers (``n_gpu_layers``
-1: the CPU build has none, so it computes on the CPU), and for each length N
(the bench text cut to exactly N tokens):

1. **cold**: the sequence emptied, the block-aligned prefill of N tokens and the
   argmax of the last logits (``cold_repeats`` times);
2. the N tokens saved as blocks into a fresh store (``PrefixCache.prepare`` and
   ``write``);
3. **restore**: the sequence emptied, ``PrefixCache.restore`` (lookup, read, load,
   probe decode: verified), then the argmax (``repeats`` times): the restore's
   time, the time to that first token, and the bytes its read calls returned
   (``rchar`` of ``/proc/self/io``, every thread).

The figures go to ``FILE`` as JSON, with what ran them: the build's devices, where
the layers computed (the identity's ``backend`` and ``offload``), the machine,
the model and the load average before and after. Which build runs is the
environment's choice (``LLAMA_CPP_LIB_PATH``); ``run`` starts one process per build.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localkv.bench.geometry.counters import io_now
from localkv.bench.run import describe_machine, describe_model, load_average
from localkv.bench.size import Say, first_token
from localkv.bench.stats import Stat
from localkv.bench.text import prompt_tokens
from localkv.cache.identity import Identity, identity_of
from localkv.cache.prefix import PrefixCache
from localkv.model.devices import offload_devices
from localkv.model.find import resolve_model
from localkv.model.native import llama_cpp
from localkv.model.session import ModelSession, SessionConfig
from localkv.storage import SnapshotStore
from localkv.storage.filehash import FileHasher

__all__ = ["Length", "MeasureConfig", "main", "measure"]

log = logging.getLogger(__name__)

BLOCK_SIZE = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasureConfig:
    """What one build's run measures: the model, the lengths, the repeats, the threads."""

    model_path: Path
    sizes: tuple[int, ...]
    repeats: int = 3
    cold_repeats: int = 2
    n_threads: int | None = None

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 2:
            raise ValueError(f"sizes must be at least 2 tokens each, got {self.sizes}")
        if self.repeats < 1 or self.cold_repeats < 1:
            raise ValueError("repeats and cold_repeats must be positive")

    def session_config(self) -> SessionConfig:
        return SessionConfig(
            model_path=self.model_path,
            n_ctx=(max(self.sizes) + 64 + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE,
            n_threads=self.n_threads,
            n_gpu_layers=-1,
            block_size=BLOCK_SIZE,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Length:
    """The figures of one length on one build (seconds unless named otherwise)."""

    tokens: int
    cold: Stat  # prefill + first token
    restore: Stat  # lookup + read + load + probe: the verified restore
    ttft: Stat  # the restore and the first token after it
    steps: dict[str, Stat]  # the restore's breakdown
    bytes_read: int  # rchar of one restore (median)
    stored_bytes: int  # the chain's block files
    state_bytes: int  # llama_state_seq_get_size after the restore
    blocks: int
    verified: bool  # every restore reused all N tokens and its probe matched
    first_token_agrees: bool  # the restores' first token is the cold prefill's

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {f: getattr(self, f) for f in self.__slots__}
        for name in ("cold", "restore", "ttft"):
            out[name] = getattr(self, name).as_json()
        out["steps"] = {k: v.as_json() for k, v in self.steps.items()}
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class _Restored:
    seconds: float
    ttft: float
    steps: dict[str, float]
    rchar: int
    verified: bool
    first: int


class _Length:
    """One length on one session: its store, its tokens and their schedule."""

    def __init__(self, session: ModelSession, identity: Identity, work: Path, n: int) -> None:
        self.session, self.n = session, n
        self.tokens = prompt_tokens(session, n)
        self.ends = session.schedule(n, [n])
        self.store = SnapshotStore.open(work / f"store-{n}")
        self.deferred: list[Callable[[], None]] = []
        self.cache = PrefixCache(
            self.store, identity, "bench", BLOCK_SIZE, defer=self.deferred.append
        )
        self.cache.packing = False  # every restore reads the blocks, whose bytes it counts

    def cold(self) -> tuple[float, int]:
        self.session.reset()
        t0 = time.perf_counter()
        self.session.prefill(self.tokens, ends=self.ends)
        first = first_token(self.session)
        return time.perf_counter() - t0, first

    def save(self, seconds_per_token: float) -> tuple[int, int]:
        """The N tokens (just prefilled) as blocks: the chain's block count and bytes."""
        blocks = self.cache.prepare(self.session, [self.n], seconds_per_token)
        saved = self.cache.write(blocks)
        if saved.tip is None:
            raise RuntimeError("nothing was saved")
        chain = self.store.chain_of(saved.tip)
        return len(chain), sum(r.stored_bytes for r in chain)

    def restore(self) -> _Restored:
        self.session.reset()
        before = io_now()
        t0 = time.perf_counter()
        result = self.cache.restore(self.session, self.tokens, self.ends)
        t1 = time.perf_counter()
        whole = result.reused == self.n
        first = first_token(self.session) if whole else -1
        t2 = time.perf_counter()
        read = io_now() - before
        for fn in self.deferred:
            fn()
        self.deferred.clear()
        return _Restored(
            seconds=t1 - t0,
            ttft=t2 - t0,
            steps=dict(result.breakdown),
            rchar=read.rchar,
            verified=whole and bool(result.verified),
            first=first,
        )


def measure_length(
    session: ModelSession,
    identity: Identity,
    work: Path,
    n: int,
    *,
    cfg: MeasureConfig,
    say: Say,
) -> Length:
    """Every figure of ``n`` tokens on ``session``, in the order the module names them."""
    one = _Length(session, identity, work, n)
    try:
        colds = []
        for i in range(cfg.cold_repeats):
            say(f"  cold prefill of {n:,} tokens ({i + 1}/{cfg.cold_repeats})")
            colds.append(one.cold())
        blocks, stored = one.save(min(c[0] for c in colds) / n)
        say(f"  verified restore of {n:,} tokens x {cfg.repeats}")
        runs = [one.restore() for _ in range(cfg.repeats)]
        state = int(llama_cpp.llama_state_seq_get_size(session.ctx, 0))
    finally:
        one.store.close()
    names = sorted({k for r in runs for k in r.steps})
    return Length(
        tokens=n,
        cold=Stat.of([c[0] for c in colds]),
        restore=Stat.of([r.seconds for r in runs]),
        ttft=Stat.of([r.ttft for r in runs]),
        steps={k: Stat.of([r.steps.get(k, 0.0) for r in runs]) for k in names},
        bytes_read=int(np.median([r.rchar for r in runs])),
        stored_bytes=stored,
        state_bytes=state,
        blocks=blocks,
        verified=all(r.verified for r in runs),
        first_token_agrees={r.first for r in runs} == {c[1] for c in colds},
    )


def build_of(session: ModelSession) -> dict[str, object]:
    """What computed: the build's offload devices and where the session's layers went."""
    return {
        "gpu_offload_build": bool(llama_cpp.llama_supports_gpu_offload()),
        "devices": [d.label() for d in offload_devices()],
        "backend": session.offload.backend(),
        "offload": session.offload.split(),
        "library": os.environ.get("LLAMA_CPP_LIB_PATH", ""),
    }


def measure(
    cfg: MeasureConfig, say: Say = log.info, work_dir: Path | None = None
) -> dict[str, Any]:
    """Every length on one session of the loaded build; the run as JSON."""
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_before = load_average()
    t0 = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="localkv-device-", dir=work_dir) as tmp,
        ModelSession(cfg.session_config()) as session,
    ):
        identity = identity_of(session, FileHasher())
        build = build_of(session)
        say(f"computing on {build['backend']} {build['offload']}".rstrip())
        lengths = []
        for n in cfg.sizes:
            say(f"{n:,} tokens")
            lengths.append(measure_length(session, identity, Path(tmp), n, cfg=cfg, say=say))
        model = describe_model(session, identity)
    return {
        "started": started,
        "seconds": time.perf_counter() - t0,
        "load_before": load_before,
        "load_after": load_average(),
        "build": build,
        "machine": describe_machine(),
        "model": model,
        "config": {"repeats": cfg.repeats, "cold_repeats": cfg.cold_repeats},
        "lengths": [length.as_json() for length in lengths],
    }


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"2048,8192"`` -> ``(2048, 8192)``; ``ValueError`` for anything else."""
    sizes = tuple(sorted({int(x) for x in text.replace(" ", "").split(",") if x}))
    if not sizes or sizes[0] < 2:
        raise ValueError(f"sizes must be at least 2 tokens each: {text!r}")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--sizes", default="2048,8192", help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="verified restores per length")
    parser.add_argument("--cold-repeats", type=int, default=2, help="cold prefills per length")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    try:
        cfg = MeasureConfig(
            model_path=resolve_model(args.model),
            sizes=parse_sizes(args.sizes),
            repeats=args.repeats,
            cold_repeats=args.cold_repeats,
            n_threads=args.threads,
        )
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.WARNING)
    doc = measure(cfg, say=lambda line: print(line, flush=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if all(x["verified"] for x in doc["lengths"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
