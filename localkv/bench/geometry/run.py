"""The geometry benchmark: every model geometry at every length, written to a directory.

``python benchmarks/geometry.py --sizes 2048,8192 --repeats 3 --out DIR``
builds the synthetic models (``models``) in a temporary directory beside the
stores, measures each (``measure``) and writes ``geometry.json`` and
``geometry.md`` into ``DIR``. The machine's load average is taken before and
after each measurement, since other work slows and scatters the timings.
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
from localkv.bench.run import describe_machine
from localkv.bench.size import Say
from localkv.model.find import resolve_model
from localkv.model.partial_state import snapshot_interval

__all__ = ["main", "run_geometry"]

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
    doc = run_geometry(sizes, repeats, args.out, names, say=lambda s: print(s, flush=True))
    print(f"load average at the end: {load()}")
    print((args.out / "geometry.md").read_text())
    return 0 if doc["results"] else 1
