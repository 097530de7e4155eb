"""The device comparison's driver: ``measure`` on the CPU build, then on a GPU build; the page.

``python -m localkv.bench.device --gpu-lib build/gpu/vulkan/lib --sizes 2048,8192
--write-docs docs/performance/device.md`` runs ``localkv.bench.device.measure`` in
one process on the CPU build (``LLAMA_CPP_LIB_PATH`` unset) and one on the GPU
build (``LLAMA_CPP_LIB_PATH`` set to ``--gpu-lib``, ``GGML_VK_VISIBLE_DEVICES`` 0
unless set: ggml's Vulkan backend passes over a CPU-type device such as Mesa's
lavapipe otherwise), one after the other with the same model, lengths and threads,
then writes the page (``report``) and the two runs as JSON beside it. A GPU build
that offloads nothing is an error: the page would compare the CPU with itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localkv.bench.device.measure import parse_sizes
from localkv.bench.device.report import markdown, verified
from localkv.bench.geometry.models import build
from localkv.bench.geometry.shapes import GEOMETRIES, by_name
from localkv.model.find import resolve_model

__all__ = ["build_env", "main", "run_build"]

log = logging.getLogger(__name__)


class DeviceBenchError(RuntimeError):
    """A build's run gave no figures, or the GPU build offloaded nothing."""


def build_env(gpu_lib: Path | None) -> dict[str, str]:
    """This process's environment for the CPU build (``None``) or the GPU build at ``gpu_lib``."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    if gpu_lib is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(gpu_lib.resolve())
        env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
    return env


def run_build(name: str, args: Sequence[str], env: dict[str, str], out: Path) -> dict[str, Any]:
    """One ``measure`` process; its JSON (written even when a restore failed to verify)."""
    command = [sys.executable, "-m", "localkv.bench.device.measure", *args, "--out", str(out)]
    print(f"[{name}] {shlex.join(command)}", flush=True)
    done = subprocess.run(command, env=env, check=False)
    if not out.is_file():
        raise DeviceBenchError(f"the {name} run wrote no figures (exit status {done.returncode})")
    run: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return run


def _measure_args(args: argparse.Namespace) -> list[str]:
    out = ["--sizes", ",".join(map(str, args.sizes)), "--repeats", str(args.repeats)]
    out += ["--cold-repeats", str(args.cold_repeats), "--threads", str(args.threads)]
    if args.model:
        out += ["--model", args.model]
    return out


def _synthetic(name: str, where: Path) -> Path:
    """The geometry benchmark's model of ``name``: real KV shapes, a narrow residual stream."""
    return build(by_name(name), where / f"{name}.gguf", resolve_model(None))


def compare(args: argparse.Namespace, command: str) -> int:
    """Both runs, then the page and the JSON; 0 when every restore of both verified."""
    with tempfile.TemporaryDirectory(prefix="localkv-device-runs-") as tmp:
        if args.geometry:
            args.model = str(_synthetic(args.geometry, Path(tmp)))
            args.note = [
                *args.note,
                f"model: the synthetic {args.geometry} of "
                "`localkv.bench.geometry` (its KV shapes, a narrow residual stream, "
                "random weights)",
            ]
        measure_args = _measure_args(args)
        cpu = run_build("CPU build", measure_args, build_env(None), Path(tmp) / "cpu.json")
        dev = run_build("GPU build", measure_args, build_env(args.gpu_lib), Path(tmp) / "gpu.json")
    if dev["build"]["backend"] == "cpu":
        raise DeviceBenchError(
            f"the GPU build at {args.gpu_lib} offloaded nothing (devices: "
            f"{dev['build']['devices'] or 'none'}); on lavapipe set GGML_VK_VISIBLE_DEVICES=0"
        )
    page = markdown(cpu, dev, command, args.note)
    if args.write_docs is not None:
        args.write_docs.parent.mkdir(parents=True, exist_ok=True)
        args.write_docs.write_text(page, encoding="utf-8")
        data = args.write_docs.with_suffix(".json")
        doc = {"command": command, "cpu": cpu, "device": dev, "notes": args.note}
        data.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.write_docs} and {data}", flush=True)
    print(page, flush=True)
    return 0 if verified(cpu) and verified(dev) else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m localkv.bench.device", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--gpu-lib", type=Path, required=True, help="the GPU build's libraries")
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument(
        "--geometry",
        default=None,
        choices=[g.name for g in GEOMETRIES],
        help="instead of --model: a synthetic model of this geometry (localkv.bench.geometry)",
    )
    parser.add_argument("--sizes", default="2048,8192", help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="verified restores per length")
    parser.add_argument("--cold-repeats", type=int, default=2, help="cold prefills per length")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads (both builds)"
    )
    parser.add_argument("--write-docs", type=Path, default=None, help="the page to write")
    parser.add_argument(
        "--command", default=None, help="the command the page names (default: this one)"
    )
    parser.add_argument(
        "--note", action="append", default=[], help="a line for the page's verified list"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        args.sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    if args.repeats < 1 or args.cold_repeats < 1 or args.threads < 1:
        parser.error("--repeats, --cold-repeats and --threads must be positive")
    if not any(args.gpu_lib.glob("libllama.*")):
        parser.error(f"no GPU build at {args.gpu_lib} (no libllama): run make gpu-build")
    given = list(sys.argv[1:] if argv is None else argv)
    command = args.command or shlex.join(["python", "-m", "localkv.bench.device", *given])
    try:
        return compare(args, command)
    except DeviceBenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
