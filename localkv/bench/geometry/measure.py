"""One model, one document length: prefill it through ``Runtime``, then restore it.

``measure(model, geometry, n, repeats, work)`` runs, each ``repeats`` times:

1. **uncached prefill**: the document's request prefilled with the cache off
   (``Runtime(use_cache=False)``), in its canonical batches;
2. **cached prefill**: ``Runtime.prefill`` into a fresh store, saves included:
   its wall time, the seconds spent in ``PrefixCache.prepare`` and ``write``
   (the save), the bytes it wrote (``counters``), the files left on disk;
   after the first, llama.cpp's own state file of the same sequence
   (``llama_state_seq_save_file``);
3. **restore**: a fresh ``Runtime`` on that store restores the request
   (``Runtime.restore``: lookup, read, load, probe), with the bytes it read;
   what it needs is the state llama.cpp then holds
   (``llama_state_seq_get_size``); a numpy copy of as many bytes is the memcpy
   it is compared with.

Each figure is the median of the repeats (``Figures``).
"""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localkv.bench.geometry.counters import Io, MethodTimer, io_now, tree_bytes
from localkv.bench.geometry.shapes import Geometry
from localkv.bench.text import prompt_tokens
from localkv.model.native import llama_cpp
from localkv.model.session import SessionConfig
from localkv.prompt.request import Document, Request
from localkv.runtime import Runtime

__all__ = ["Figures", "document_for", "measure", "session_config"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Figures:
    """The medians of one model at one length (bytes, seconds)."""

    tokens: int  # the request's tokens (the document and its template)
    kept: int  # tokens the cache holds after the prefill
    reused: int  # tokens the restore brought back
    verified: bool  # every restore verified by its probe
    rows_once: int
    disk: int  # every file under the store after the prefill
    llama_state_file: int
    written: int  # write_bytes of the cached prefill
    written_wchar: int
    restore_read: int  # rchar of the restore
    restore_storage_read: int  # read_bytes of the restore (page-cache misses only)
    needed: int  # llama_state_seq_get_size after the restore
    prefill_s: float  # uncached prefill
    cached_prefill_s: float  # Runtime.prefill, saves included
    save_s: float  # inside PrefixCache.prepare and write
    restore_s: float  # lookup + read + load
    probe_s: float
    memcpy_s: float  # numpy copy of ``needed`` bytes

    def as_json(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in self.__slots__}


def document_for(rt: Runtime, n: int) -> Document:
    """The bench text cut to ``n`` tokens of this model, as a document."""
    return Document.from_text(rt.session.detokenize(prompt_tokens(rt.session, n)), f"doc-{n}.txt")


def session_config(model: Path, n: int) -> SessionConfig:
    # one thread: on a machine whose cores are shared, spinning threads are much slower
    # than one (llama.cpp waits for every thread at each step;
    # docs/performance/geometry.md says by how much)
    return SessionConfig(model_path=model, n_ctx=(n + 512) // 256 * 256 + 256, n_threads=1)


def _uncached(model: Path, n: int) -> tuple[float, Request]:
    with Runtime(session_config(model, n), use_cache=False) as rt:
        request = rt.build([document_for(rt, n)], system=None)
        ends = rt.schedule(request)
        t0 = time.perf_counter()
        rt.session.prefill(request.tokens, ends=ends)
        return time.perf_counter() - t0, request


@dataclass(frozen=True, slots=True, kw_only=True)
class _Prefill:
    seconds: float
    save_s: float
    written: Io
    disk: int
    kept: int
    state_file: int


def _cached(model: Path, n: int, store: Path, state_file: Path | None) -> _Prefill:
    with Runtime(session_config(model, n), cache_dir=store) as rt:
        if rt.cache is None:
            raise RuntimeError(f"no cache: {rt.cache_error}")
        timer = MethodTimer(rt.cache, "prepare", "write")
        doc = document_for(rt, n)
        before = io_now()
        report = rt.prefill([doc], system=None)
        rt.wait_for_saves()
        written = io_now() - before
        size = 0
        if state_file is not None:
            size = _save_state_file(rt, state_file)
    return _Prefill(
        seconds=report.seconds,
        save_s=timer.seconds,
        written=written,
        disk=tree_bytes(store),
        kept=report.kept,
        state_file=size,
    )


def _save_state_file(rt: Runtime, path: Path) -> int:
    tokens = rt.session.tokens
    arr = (llama_cpp.llama_token * len(tokens))(*tokens)
    if not llama_cpp.llama_state_seq_save_file(
        rt.session.ctx, str(path).encode(), 0, arr, len(tokens)
    ):
        raise RuntimeError(f"llama_state_seq_save_file failed for {path}")
    size = path.stat().st_size
    path.unlink()
    return size


@dataclass(frozen=True, slots=True, kw_only=True)
class _Restore:
    seconds: float
    probe_s: float
    read: Io
    reused: int
    verified: bool
    needed: int


def _restores(model: Path, n: int, store: Path, request: Request, repeats: int) -> list[_Restore]:
    out = []
    with Runtime(session_config(model, n), cache_dir=store) as rt:
        ends = rt.schedule(request)
        for _ in range(repeats):
            before = io_now()
            result, report = rt.restore(request.tokens, ends)
            read = io_now() - before
            steps = result.breakdown if result else {}
            needed = int(llama_cpp.llama_state_seq_get_size(rt.session.ctx, 0))
            out.append(
                _Restore(
                    seconds=sum(steps.get(s, 0.0) for s in ("lookup", "read", "load")),
                    probe_s=steps.get("probe", 0.0),
                    read=read,
                    reused=report.reused,
                    verified=bool(report.verified),
                    needed=needed,
                )
            )
    return out


def memcpy_seconds(n_bytes: int, repeats: int) -> float:
    """The median seconds of a numpy copy of ``n_bytes`` between two ready buffers."""
    src = np.ones(n_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    times = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median(values: list[float] | list[int]) -> float:
    return float(statistics.median(values))


def measure(model: Path, g: Geometry, n: int, repeats: int, work: Path) -> Figures:
    """Every figure of ``g``'s model (``model``) at ``n`` tokens: medians of ``repeats``."""
    prefills, cached, restores = [], [], []
    request: Request | None = None
    for i in range(repeats):
        seconds, request = _uncached(model, n)
        prefills.append(seconds)
        store = work / f"{g.name}-{n}-{i}"
        shutil.rmtree(store, ignore_errors=True)
        cached.append(_cached(model, n, store, work / "llama-state.bin" if i == 0 else None))
        restores += _restores(model, n, store, request, 1 if i else repeats)
        shutil.rmtree(store, ignore_errors=True)
    if request is None:
        raise ValueError("repeats must be at least 1")
    tokens = len(request.tokens)
    needed = int(_median([r.needed for r in restores]))
    return Figures(
        tokens=tokens,
        kept=min(c.kept for c in cached),
        reused=min(r.reused for r in restores),
        verified=all(r.verified for r in restores),
        rows_once=g.rows_once(tokens),
        disk=int(_median([c.disk for c in cached])),
        llama_state_file=cached[0].state_file,
        written=int(_median([c.written.write_bytes for c in cached])),
        written_wchar=int(_median([c.written.wchar for c in cached])),
        restore_read=int(_median([r.read.rchar for r in restores])),
        restore_storage_read=int(_median([r.read.read_bytes for r in restores])),
        needed=needed,
        prefill_s=_median(prefills),
        cached_prefill_s=_median([c.seconds for c in cached]),
        save_s=_median([c.save_s for c in cached]),
        restore_s=_median([r.seconds for r in restores]),
        probe_s=_median([r.probe_s for r in restores]),
        memcpy_s=memcpy_seconds(needed, repeats),
    )
