"""The geometry benchmark: every model geometry at every length, written to a directory.

``python benchmarks/geometry.py --sizes 2048,8192 --repeats 3 --out DIR``
builds the synthetic models (``models``) in a temporary directory beside the
stores, measures each (``measure``) and writes ``geometry.json`` and
``geometry.md`` into ``DIR``. The machine's load average is taken before and
after each measurement, since other work slows and scatters the timings.

``python benchmarks/geometry.py --synthetic 32768 --out DIR`` measures instead
the restore of a synthetic chain (``synthetic``: random rows, no prefill) of
each length at the Llama 3.1 8B geometry (``--models`` for others) and writes
its section of ``DIR/geometry.md`` and its key of ``DIR/geometry.json``
(``synthetic_page``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from localkv.bench.geometry.measure import measure
from localkv.bench.geometry.models import N_EMBD, build
from localkv.bench.geometry.report import derived, markdown
from localkv.bench.geometry.shapes import GEOMETRIES, Geometry, by_name
from localkv.bench.geometry.synthetic import measure_synthetic
from localkv.bench.geometry.synthetic_page import derived as synthetic_derived
from localkv.bench.geometry.synthetic_page import section
from localkv.bench.geometry.synthetic_page import write as write_synthetic
from localkv.bench.run import describe_machine
from localkv.bench.size import Say
from localkv.model.find import resolve_model
from localkv.model.partial_state import snapshot_interval

__all__ = ["main", "run_geometry", "run_synthetic"]

SYNTHETIC_DEFAULT = "llama-3.1-8b"

log = logging.getLogger(__name__)


def load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _describe(g: Geometry, block_size: int) -> dict[str, object]:
    out: dict[str, object] = {
        "layers": g.n_layer,
        "full_attention_layers": g.count("full"),
        "sliding_layers": g.count("swa"),
        "window": g.window,
        "recurrent_layers": g.count("ssm"),
        "kv_heads": g.n_head_kv,
        "head_dim": g.head_dim,
        "kv_bytes_per_token": g.kv_bytes_per_token,
        "recurrent_state_bytes": g.recurrent_bytes,
        "gguf_architecture": g.arch,
        "residual_stream": N_EMBD,
    }
    if g.ssm is not None:
        out["snapshot_interval"] = snapshot_interval(
            g.recurrent_bytes, g.kv_bytes_per_token, block_size
        )
    return out


def run_geometry(
    sizes: Sequence[int],
    repeats: Sequence[int],
    out: Path,
    names: Sequence[str] = (),
    say: Say = log.info,
    *,
    work_dir: Path | None = None,
) -> dict[str, object]:
    """Measure, write ``geometry.json`` and ``geometry.md`` into ``out``; the results."""
    geometries = [by_name(n) for n in names] if names else list(GEOMETRIES)
    tokenizer = resolve_model(None)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, object]] = []
    doc: dict[str, object] = {}
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="localkv-geometry-", dir=work_dir) as tmp:
        work = Path(tmp)
        models = {g.name: build(g, work / f"{g.name}.gguf", tokenizer) for g in geometries}
        for n, times in zip(sizes, repeats, strict=True):
            for g in geometries:
                model = models[g.name]
                say(f"{g.label}, {n:,} tokens, {times} repeats (load {load()})")
                before = load()
                figures = measure(model, g, n, times, work).as_json()
                results.append(
                    {
                        "model": g.name,
                        "label": g.label,
                        "size": n,
                        "repeats": times,
                        "geometry": _describe(g, 256),
                        "figures": figures,
                        "derived": derived(figures),
                        "load_before": before,
                        "load_after": load(),
                    }
                )
                say(f"  {json.dumps(results[-1]['derived'])}")
                doc = _write(
                    out, sizes, repeats, started, time.perf_counter() - t0, results=results
                )
    return doc


def run_synthetic(
    sizes: Sequence[int],
    repeats: int,
    out: Path,
    names: Sequence[str] = (),
    say: Say = log.info,
    *,
    work_dir: Path | None = None,
) -> dict[str, object]:
    """Measure synthetic chains (``synthetic``), write their section into ``out``; the run."""
    geometries = [by_name(n) for n in names or [SYNTHETIC_DEFAULT]]
    tokenizer = resolve_model(None)
    results: list[dict[str, object]] = []
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.perf_counter()
    run: dict[str, object] = {
        "command": f"python benchmarks/geometry.py --synthetic {','.join(map(str, sizes))} "
        f"--repeats {repeats} --models {','.join(g.name for g in geometries)} --out {out}",
        "started": started,
        "machine": describe_machine(),
        "results": results,
    }
    with tempfile.TemporaryDirectory(prefix="localkv-synthetic-", dir=work_dir) as tmp:
        work = Path(tmp)
        for g in geometries:
            model = build(g, work / f"{g.name}.gguf", tokenizer)
            for n in sizes:
                before = load()
                say(f"{g.label}, synthetic chain of {n:,} tokens, {repeats} repeats")
                figures = measure_synthetic(model, n, repeats, work)
                row = {"model": g.name, "label": g.label, "size": n, "repeats": repeats}
                row |= {"geometry": _describe(g, 256), "figures": figures}
                row |= {"derived": synthetic_derived(figures), "load_before": before}
                results.append({**row, "load_after": load()})
                say(f"  {json.dumps(results[-1]['derived'])}")
                run["seconds"] = round(time.perf_counter() - t0, 1)
                write_synthetic(out, run)
    return run


def _write(
    out: Path,
    sizes: Sequence[int],
    repeats: Sequence[int],
    started: str,
    seconds: float,
    *,
    results: list[dict[str, object]],
) -> dict[str, object]:
    """Write both files with the results so far (a run cut short keeps its rows)."""
    doc = {
        "command": f"python benchmarks/geometry.py --sizes {','.join(map(str, sizes))} "
        f"--repeats {','.join(map(str, repeats))} --out {out}",
        "started": started,
        "seconds": round(seconds, 1),
        "machine": describe_machine(),
        "results": results,
    }
    (out / "geometry.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "geometry.md").write_text(markdown(results, _notes(doc)))
    return doc


def _notes(doc: dict[str, object]) -> list[str]:
    loads = [r["load_before"] for r in doc["results"]]  # type: ignore[attr-defined]
    machine = doc["machine"]
    return [
        f"Command: `{doc['command']}`; medians of the repeats; "
        f"{doc['seconds']} s in all; started {doc['started']}.",
        f"Machine: {machine['cpu']}, {machine['cores']} cores; "  # type: ignore[index]
        f"load average (1, 5, 15 min) before each row: {loads}.",
        "On disk: every file under the store after `Runtime.prefill` (block files and "
        "index). Rows once: every K/V row of every layer once (f16), plus one recurrent "
        "state where the model has one. llama.cpp state file: `llama_state_seq_save_file` "
        "of the same sequence.",
        "Written: `write_bytes` of /proc/self/io over `Runtime.prefill` (the saves "
        "included), counted as pages are dirtied.",
        "Restore read: `rchar` of /proc/self/io over `Runtime.restore` (every read system "
        "call: block files and index; the files are in the page cache). Needed: "
        "`llama_state_seq_get_size` of the restored sequence.",
        "Restore: lookup + read + load (the probe decode is apart), against a numpy copy "
        "of the needed bytes. Save: seconds inside `PrefixCache.prepare` and `write`, "
        "against the uncached prefill of the same request.",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2048,8192", help="document lengths in tokens")
    parser.add_argument(
        "--repeats", default="3", help="runs of each measurement: one number, or one per size"
    )
    parser.add_argument("--out", type=Path, required=True, help="where the results go")
    parser.add_argument(
        "--models",
        default="",
        help="geometries (default: all): " + ", ".join(g.name for g in GEOMETRIES),
    )
    parser.add_argument(
        "--synthetic",
        default="",
        help="document lengths in tokens: restore a synthetic chain of each instead",
    )
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        repeats = [int(s) for s in args.repeats.split(",") if s.strip()]
    except ValueError:
        parser.error("--sizes and --repeats must be comma-separated integers")
    repeats = repeats * len(sizes) if len(repeats) == 1 else repeats
    if not sizes or min(sizes) < 64 or len(repeats) != len(sizes) or min(repeats) < 1:
        parser.error(
            "--sizes must each be at least 64, --repeats at least 1 (one, or one per size)"
        )
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    for n in names:
        try:
            by_name(n)
        except ValueError as exc:
            parser.error(str(exc))
    logging.basicConfig(level=logging.WARNING)
    print(f"load average at the start: {load()}", flush=True)
    if args.synthetic:
        return _synthetic(args.synthetic, repeats[0], args.out, names, parser)
    doc = run_geometry(sizes, repeats, args.out, names, say=lambda s: print(s, flush=True))
    print(f"load average at the end: {load()}")
    print((args.out / "geometry.md").read_text())
    return 0 if doc["results"] else 1


def _synthetic(
    sizes: str, repeats: int, out: Path, names: list[str], parser: argparse.ArgumentParser
) -> int:
    try:
        lengths = [int(s) for s in sizes.split(",") if s.strip()]
    except ValueError:
        parser.error("--synthetic must be comma-separated integers")
    if not lengths or min(lengths) < 64:
        parser.error("--synthetic lengths must each be at least 64")
    run = run_synthetic(lengths, repeats, out, names, say=lambda s: print(s, flush=True))
    print(f"load average at the end: {load()}")
    print(section(run))
    return 0 if run["results"] else 1
