"""Two checkouts' fresh ``localkv ask`` in turn, on one warm cache each: first answer byte.

    .venv/bin/python benchmarks/ask_ab.py --python NAME=PY --python NAME=PY [--runs 8]
        [--tokens 2000] [--set VAR=VALUE ...]

Each ``PY`` is a checkout's own venv Python. One document of about ``--tokens``
tokens is prefilled into a fresh cache per checkout; then the checkouts answer a
new question each in turn (A, B, A, B, ...), so both see the same machine. The
figure is the seconds from starting the command to the first byte of the answer
on its stdout (``benchmarks/faces.py``'s ``ask`` face). ``--set`` puts a variable
in both environments (e.g. ``GOMP_SPINCOUNT=300000`` to compare with one OpenMP
setting); OpenMP variables are otherwise removed. Prints the medians and runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from faces import SYSTEM, first_byte, question

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", action="append", required=True, help="NAME=PYTHON")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--set", action="append", default=[], help="VAR=VALUE for both")
    args = ap.parse_args()
    from faces import _documents

    from localkv.model.resolve import resolve_model

    model = resolve_model(None)
    work = Path(tempfile.mkdtemp(prefix="localkv-ask-ab-"))
    doc = _documents(model, args.tokens, work)["A"]
    pythons = {n: str(Path(p).absolute()) for n, p in (x.split("=", 1) for x in args.python)}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "LOCALKV_"))}
    env |= dict(s.split("=", 1) for s in args.set)
    ctx = (args.tokens + 512 + 255) // 256 * 256
    common = ["--model", str(model), "--ctx", str(ctx), "--flash-attn", "on", "--system", SYSTEM]
    for name, py in pythons.items():
        home = {**env, "LOCALKV_HOME": str(work / name)}
        cmd = [py, "-m", "localkv", "prefill", *common, str(doc)]
        subprocess.run(cmd, env=home, cwd=work, check=True, capture_output=True)
    runs: dict[str, list[float]] = {name: [] for name in pythons}
    for i in range(args.runs):
        for name, py in pythons.items():
            cmd = [py, "-m", "localkv", "ask", *common, "--temperature", "0"]
            cmd += ["--max-tokens", "8", str(doc), question(i)]
            home = {**env, "LOCALKV_HOME": str(work / name)}
            runs[name].append(first_byte(cmd, home, work / f"{name}.log"))
    print(f"load average after: {os.getloadavg()[0]:.2f}; set: {' '.join(args.set) or 'nothing'}")
    for name, seconds in runs.items():
        each = ", ".join(f"{s * 1000:.0f}" for s in seconds)
        print(f"{name}: median {statistics.median(seconds) * 1000:.0f} ms ({each})")


if __name__ == "__main__":
    main()
