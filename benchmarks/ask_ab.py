"""Two checkouts' fresh ``localkv ask`` (or ``Runtime.ask``) in turn: the warm first token.

    .venv/bin/python benchmarks/ask_ab.py --python NAME=PY --python NAME=PY [--runs 8]
        [--tokens 2000] [--set VAR=VALUE ...] [--face ask|api] [--flash-attn off|on]
        [--threads NAME=N ...] [--load N [--load-group same|own]]

Each ``PY`` is a checkout's own venv Python. One document of about ``--tokens``
tokens is prefilled into a fresh cache per checkout; then the checkouts answer a
new question each in turn (A, B, A, B, ...), so both see the same machine. The
figure is the seconds from starting the command to the first byte of the answer
on its stdout (``benchmarks/faces.py``'s ``ask`` face). ``--set`` puts a variable
in both environments (e.g. ``GOMP_SPINCOUNT=300000`` to compare with one OpenMP
setting); OpenMP variables are otherwise removed. ``--face api`` measures
``faces.py``'s ``api`` face instead: per turn, one process per checkout answers 7
new questions about two documents in turn (the first, in a cold process, is not
counted), seconds from the call to the first text. Both checkouts run with
``--flash-attn`` (off by default: what localkv's ``auto`` is on a CPU at this
size, as in ``faces.py``). ``--threads NAME=N`` gives that entry ``--threads N``
(one Python may be named twice, e.g. to compare one thread with two); the others
keep localkv's default (``model.threads.ThreadFit``). ``--load N`` runs the turns
beside N CPU-bound processes (``faces.py``'s load: in the bench's session, or with
``--load-group own`` in a session of their own). Prints the medians and runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from faces import API_WORKER, SYSTEM, _spin, _stop_spin, first_byte, question

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _api(
    py: str,
    opened: dict[str, Any],
    docs: dict[str, Path],
    base: int,
    env: dict[str, str],
    *,
    at: Path,
) -> list[float]:
    """``opened``: ``Runtime.open``'s model, n_ctx, flash attention (``fa``) and threads (None:
    localkv's default, ``model.threads.ThreadFit``)."""
    p = {**opened, "runs": 7}
    p |= {"max_tokens": 16, "system": SYSTEM, "docs": [str(docs["A"]), str(docs["B"])]}
    p["questions"] = [question(base + i) for i in range(7)]
    cmd = [py, "-c", API_WORKER, json.dumps(p)]
    done = subprocess.run(cmd, env=env, cwd=at, capture_output=True, text=True, check=True)
    return list(json.loads(done.stdout.strip().splitlines()[-1])["ttft_s"][1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", action="append", required=True, help="NAME=PYTHON")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--set", action="append", default=[], help="VAR=VALUE for both")
    ap.add_argument("--face", choices=("ask", "api"), default="ask")
    ap.add_argument("--flash-attn", choices=("on", "off"), default="off")
    ap.add_argument("--threads", action="append", default=[], help="NAME=N for that entry")
    ap.add_argument("--load", type=int, default=0, help="CPU-bound processes beside the turns")
    ap.add_argument("--load-group", choices=("same", "own"), default="same")
    args = ap.parse_args()
    from faces import _documents

    from localkv.model.find import resolve_model

    model = resolve_model(None)
    work = Path(tempfile.mkdtemp(prefix="localkv-ask-ab-"))
    docs = _documents(model, args.tokens, work)
    doc = docs["A"]
    pythons = {n: str(Path(p).absolute()) for n, p in (x.split("=", 1) for x in args.python)}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "LOCALKV_"))}
    env |= dict(s.split("=", 1) for s in args.set)
    ctx = (args.tokens + 512 + 255) // 256 * 256
    common = ["--model", str(model), "--ctx", str(ctx), "--flash-attn", args.flash_attn]
    common += ["--system", SYSTEM]
    threads = {n: int(t) for n, t in (x.split("=", 1) for x in args.threads)}
    if unknown := set(threads) - set(pythons):
        ap.error(f"--threads names no --python: {', '.join(sorted(unknown))}")
    for name, py in pythons.items():
        home = {**env, "LOCALKV_HOME": str(work / name)}
        for d in docs.values():
            cmd = [py, "-m", "localkv", "prefill", *common, str(d)]
            subprocess.run(cmd, env=home, cwd=work, check=True, capture_output=True)
    opened = {"model": str(model), "n_ctx": ctx, "fa": args.flash_attn}
    runs: dict[str, list[float]] = {name: [] for name in pythons}
    spin = _spin(args.load, args.load_group == "own")
    try:
        for i in range(args.runs):
            for name, py in pythons.items():
                home = {**env, "LOCALKV_HOME": str(work / name)}
                if args.face == "api":
                    mine = {**opened, "threads": threads.get(name)}
                    runs[name] += _api(py, mine, docs, 7 * (i * len(pythons) + 1), home, at=work)
                    continue
                cmd = [py, "-m", "localkv", "ask", *common, "--temperature", "0"]
                cmd += ["--threads", str(threads[name])] if name in threads else []
                cmd += ["--max-tokens", "8", str(doc), question(i)]
                runs[name].append(first_byte(cmd, home, work / f"{name}.log"))
        load = os.getloadavg()[0]
    finally:
        _stop_spin(spin)
    said = " ".join(args.set) or "nothing"
    fa = f"flash attention {args.flash_attn}"
    beside = f"{args.load} CPU-bound processes ({args.load_group} session)" if args.load else "idle"
    print(f"{beside}; load average at the end: {load:.2f}; {fa}; set: {said}")
    for name, seconds in runs.items():
        each = ", ".join(f"{s * 1000:.0f}" for s in seconds)
        print(f"{name}: median {statistics.median(seconds) * 1000:.0f} ms ({each})")


if __name__ == "__main__":
    main()
