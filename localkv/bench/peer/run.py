"""``python -m localkv.bench.peer``: localkv beside llama-server, in one run; the page and its JSON.

    python -m localkv.bench.peer [--tokens 2000 6000] [--repeats 5] [--quick]
        [--llama-server build/llama-server/bin/llama-server] [--model PATH] [--threads 2]
        [--write-docs docs/performance/peer.md]

For each length: cold prefill and decode (``cold``), the first token after a restart
(``restart``); then two documents in turn at the first length (``alternate``). Both
servers get the same model, context (the longest prompt and room to answer), threads
and flash attention (off). ``--quick``: short documents and two runs a figure, for a
test. Writes the page and the run's JSON beside it (``--write-docs``), else prints the
page.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localkv.bench.peer.alternate import alternate
from localkv.bench.peer.cold import cold
from localkv.bench.peer.documents import documents
from localkv.bench.peer.plan import Plan, say
from localkv.bench.peer.report import markdown
from localkv.bench.peer.restart import restart
from localkv.bench.peer.servers import Setting, stop_all
from localkv.bench.run import describe_machine
from localkv.model.find import resolve_model

__all__ = ["LLAMA_SERVER", "main"]

LLAMA_SERVER = Path("build/llama-server/bin/llama-server")  # where make llama-server puts it
QUICK_TOKENS = (300,)
ANSWER_ROOM = 512  # context past the longest document: template, question, answer


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _version(binary: Path) -> str:
    done = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    lines = (done.stdout + done.stderr).splitlines()
    return next((x.strip() for x in lines if x.startswith("version")), "version unknown")


def measure(plan: Plan, tokens: Sequence[int]) -> dict[str, Any]:
    """Every figure of the run, as JSON."""
    model = plan.setting.model
    lengths = []
    for n in tokens:
        doc = documents(model, n)["A"]
        lengths.append({"tokens": n, "cold": cold(plan, n, doc), "restart": restart(plan, n, doc)})
    n = tokens[0]
    runs = alternate(plan, n, documents(model, n, ("A", "B")))
    return {"lengths": lengths, "alternate": {"tokens": n, "runs": runs}}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m localkv.bench.peer", description=str(__doc__).splitlines()[0]
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000, 6000])
    parser.add_argument("--repeats", type=int, default=5, help="runs a figure (median)")
    parser.add_argument("--quick", action="store_true", help="short documents, 2 runs: a test")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--threads", type=int, default=2, help="both servers' threads")
    parser.add_argument("--max-tokens", type=int, default=32, help="every answer's bound")
    parser.add_argument("--timeout", type=float, default=600.0, help="every request's bound (s)")
    parser.add_argument("--write-docs", type=Path, default=None, help="the page to write")
    return parser


def _plan(args: argparse.Namespace, work: Path) -> Plan:
    setting = Setting(
        model=resolve_model(args.model),
        n_ctx=(max(args.tokens) + ANSWER_ROOM + 255) // 256 * 256,
        threads=args.threads,
    )
    return Plan(
        setting=setting,
        llama_server=args.llama_server.resolve(),
        work=work,
        repeats=args.repeats,
        max_tokens=args.max_tokens,
        timeout_s=args.timeout,
    )


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The run's JSON: the figures, the setting, the machine and the load around them."""
    started, before, t0 = time.strftime("%Y-%m-%d %H:%M %Z"), _load(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="localkv-peer-") as tmp:
        plan = _plan(args, Path(tmp))
        say("setup", f"model {plan.setting.model.name}, n_ctx {plan.setting.n_ctx}, load {before}")
        figures = measure(plan, args.tokens)
    model = plan.setting.model
    return {
        "command": command,
        "started": started,
        "seconds": time.monotonic() - t0,
        "load": {"before": before, "after": _load()},
        "machine": describe_machine(),
        "model": {"name": model.name, "file_bytes": model.stat().st_size},
        "setting": {
            "n_ctx": plan.setting.n_ctx,
            "threads": plan.setting.threads,
            "max_tokens": plan.max_tokens,
            "repeats": plan.repeats,
        },
        "llama_server": {"path": str(args.llama_server), "version": _version(plan.llama_server)},
        **figures,
    }


def _write(data: dict[str, Any], page: Path | None) -> None:
    text = markdown(data)
    if page is None:
        print(text, flush=True)
        return
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text, encoding="utf-8")
    page.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {page} and {page.with_suffix('.json')}", flush=True)


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # the servers are stopped on the way out


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    if args.quick:
        args.tokens, args.repeats = list(QUICK_TOKENS), 2
    if min(args.tokens) < 1 or args.repeats < 1 or args.threads < 1 or args.max_tokens < 2:
        parser.error("--tokens, --repeats and --threads must be positive, --max-tokens >= 2")
    if not os.access(args.llama_server, os.X_OK):
        parser.error(f"no llama-server at {args.llama_server}: run make llama-server")
    command = shlex.join(["python", "-m", "localkv.bench.peer", *given])
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        _write(run(args, command), args.write_docs)
    finally:
        stop_all()
        signal.signal(signal.SIGTERM, previous)
    return 0
