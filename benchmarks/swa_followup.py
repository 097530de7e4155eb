"""A follow-up question and two alternating documents through ``localkv serve``, beside
llama.cpp's own server (llama-server), on a sliding-window model (Gemma 3 270M).

    .venv/bin/python benchmarks/swa_followup.py [--model PATH] [--llama-server PATH]
        [--tokens 2000] [--runs 5] [--threads 2] [--write-json PATH]

Both servers run at once with the same model, context, threads and chat format
(``gemma``: the model's GGUF has no template, and localkv chooses that format for
it too; llama-server gets ``--no-jinja``, without which it would render every
prompt as the word "gemma"), llama-server with its default flags otherwise. Two
scenes, each request a
streamed chat completion (greedy, 8 tokens) whose time to first content chunk is
measured by the client:

- ``followup``: one system prompt of about ``--tokens`` tokens, then a new question
  after it on every request (the first request, which computes the system prompt, is
  a warm-up);
- ``alternate``: two documents of that size as system prompts, each asked a new
  question in turn (A, B, A, B, ...; the first two are warm-ups).

Each scene starts its own servers (a fresh cache); each run sends one request to each
server, the servers interleaved, and the load average is read before every run.
Without ``--llama-server``, the binary at ``LLAMA_SERVER`` runs (none:
``--localkv-only``). The table prints, beside the median times, each server's prompt
tokens and cached tokens as its usage says (the same prompts: the same work), and
where localkv's reused tokens came from.

``measure(...)`` is the function behind the command: it returns the results as a
dict (what ``--write-json`` writes) for a page generator to call.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from faces import stop_server, wait_ready  # benchmarks/faces.py, beside this file
from support.server import free_port

from localkv.bench.peer.client import stream_chat

# built by `make llama-server` from the llama.cpp that llama-cpp-python vendors
LLAMA_SERVER = (
    Path(__file__).resolve().parents[1] / "build" / "llama-server" / "bin" / "llama-server"
)
QUESTIONS = [
    "Who is sitting by her sister?",
    "What did the Rabbit take out of its pocket?",
    "Where did Alice go after the Rabbit?",
    "What was Alice considering in her own mind?",
    "Why did Alice start to her feet?",
    "What did the book have no pictures of?",
    "How did Alice feel on that hot day?",
    "What colour were the Rabbit's eyes?",
    "What did the Rabbit say to itself?",
    "Under what did the rabbit-hole lie?",
    "What did Alice wonder about afterwards?",
    "What flashed across Alice's mind?",
]


def documents(model: Path, n_tokens: int, count: int) -> list[str]:
    """``count`` texts of about ``n_tokens`` tokens each, set apart by their first line."""
    import llama_cpp

    from localkv.bench.text import bench_text

    vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    tokens = vocab.tokenize(bench_text(n_tokens // 200 + 2).encode(), add_bos=False)
    body = vocab.detokenize(tokens[:n_tokens]).decode("utf-8", "replace")
    return [f"Notes {chr(65 + i)}, kept for the reader.\n\n{body}" for i in range(count)]


class Peer:
    """One running server: localkv's or llama-server, on its own port."""

    def __init__(self, kind: str, command: list[str], work: Path, health: str) -> None:
        self.kind, self.work = kind, work
        self.port = free_port()
        log = (work / f"{kind}.log").open("ab")
        env = {**os.environ, "LOCALKV_HOME": str(work / f"{kind}-home")}
        args = [*command, "--port", str(self.port)]
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        wait_ready(self.proc, f"http://127.0.0.1:{self.port}{health}", work / f"{kind}.log")

    def ask(self, system: str, question: str) -> tuple[float, dict[str, Any]]:
        """Seconds to the first content chunk of a streamed chat completion, and the last
        ``localkv`` object of the stream (localkv only)."""
        reply = stream_chat(
            self.port,
            [{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=8,
            timeout_s=600,
        )
        cached = reply.localkv.get("cached_tokens", reply.timings.get("cache_n"))
        return reply.ttft_s, {
            **reply.localkv,
            "prompt_tokens": reply.prompt_tokens,
            "cached": cached,
        }


@contextmanager
def started(kind: str, command: list[str], work: Path, health: str) -> Iterator[Peer]:
    peer = Peer(kind, command, work, health)
    try:
        yield peer
    finally:
        stop_server(peer.proc)


def commands(model: Path, threads: int, ctx: int, llama_server: Path | None) -> dict[str, Any]:
    """Each server's command (no port) and its health path."""
    fmt = ["--chat-template", "gemma"]
    localkv = [sys.executable, "-m", "localkv", "serve", "--model", str(model), *fmt]
    out: dict[str, Any] = {
        "localkv": ([*localkv, "--ctx", str(ctx), "--threads", str(threads)], "/health")
    }
    if llama_server is not None:
        # --no-jinja: the built-in format named; with Jinja on (its default) llama-server
        # would take "gemma" as a template's text and render every prompt as that word
        peer = [str(llama_server), "-m", str(model), "--no-jinja", *fmt, "--host", "127.0.0.1"]
        out["llama-server"] = ([*peer, "-c", str(ctx), "-t", str(threads)], "/health")
    return out


def measure(
    *,
    model: Path,
    threads: int = 2,
    ctx: int = 4096,
    n_tokens: int = 2000,
    runs: int = 5,
    llama_server: Path | None = None,
) -> dict[str, Any]:
    """Run each scene on fresh servers; the times (s), each request's usage and the loads."""
    system, doc_a, doc_b = documents(model, n_tokens, 3)
    servers = commands(model, threads, ctx, llama_server)
    times: dict[str, dict[str, list[float]]] = {kind: {} for kind in servers}
    requests: dict[str, list[dict[str, Any]]] = {}
    loads: list[float] = []
    scenes = {  # the warm-up prompts, then the prompt of each run
        "followup": ([system], [system] * runs),
        "alternate": ([doc_a, doc_b], [(doc_a, doc_b)[run % 2] for run in range(runs)]),
    }
    for scene, (warm, prompts) in scenes.items():
        work = Path(tempfile.mkdtemp(prefix="lkv-swafollow-"))
        requests[scene] = []
        try:
            with ExitStack() as stack:
                peers = [
                    stack.enter_context(started(kind, cmd, work, health))
                    for kind, (cmd, health) in servers.items()
                ]
                for peer in peers:
                    for i, text in enumerate(warm):
                        peer.ask(text, QUESTIONS[-1 - i])
                    times[peer.kind][scene] = []
                for run, text in enumerate(prompts):
                    loads.append(os.getloadavg()[0])
                    for peer in peers:  # the servers interleaved
                        t, info = peer.ask(text, QUESTIONS[run % 9])
                        times[peer.kind][scene].append(t)
                        requests[scene].append({"server": peer.kind, "run": run, **info})
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return {
        "model": str(model),
        "threads": threads,
        "ctx": ctx,
        "tokens": n_tokens,
        "runs": runs,
        "load_1min": loads,
        "seconds": times,
        "requests": requests,
    }


def table(result: dict[str, Any]) -> str:
    """The medians, the ratio to llama-server and localkv's reuse, as text."""
    times, reuse = result["seconds"], result["requests"]
    lines = [
        f"model {Path(result['model']).name}, ~{result['tokens']:,} tokens, n_ctx "
        f"{result['ctx']}, {result['threads']} threads, {result['runs']} runs; load "
        + ", ".join(f"{x:.2f}" for x in result["load_1min"]),
        f"{'scene':<10} {'server':<13} {'median TTFT':>12} {'ratio':>6}  prompt tokens, reused",
    ]
    for scene in ("followup", "alternate"):
        base = times.get("llama-server", {}).get(scene)
        for kind, by_scene in times.items():
            med = statistics.median(by_scene[scene])
            ratio = f"{med / statistics.median(base):.2f}x" if base else ""
            info = ""
            mine = [r for r in reuse[scene] if r["server"] == kind]
            prompt = sorted({r.get("prompt_tokens") for r in mine}, key=str)
            cached = sorted({r.get("cached") for r in mine}, key=str)
            info = f"prompt {prompt}, cached {cached}"
            if kind == "localkv":
                sources = sorted({str(r.get("source")) for r in mine})
                restore = statistics.median(float(r.get("restore_ms") or 0) for r in mine)
                info += f", from {'/'.join(sources)}, restore {restore:.0f}ms"
            lines.append(f"{scene:<10} {kind:<13} {med * 1000:>10.0f}ms {ratio:>6}  {info}")
    return "\n".join(lines)


TARGET = 1.2  # localkv's median time to first token over llama-server's, at most


def _cell(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    return f"{statistics.median(ms):,.0f} ms ({ms[0]:,.0f}-{ms[-1]:,.0f})"


def _steps(mine: list[dict[str, Any]]) -> str:
    """localkv's own medians: its restore's steps, the rest of the prompt, the first token."""
    keys = ("lookup", "read", "load", "probe")
    steps = [r.get("restore_steps") or {} for r in mine]
    parts = [f"{k} {statistics.median(float(s.get(k, 0.0)) for s in steps):.0f}" for k in keys]
    prompt = statistics.median(float(r.get("prompt_ms") or 0) for r in mine)
    ttft = statistics.median(float(r.get("ttft_ms") or 0) for r in mine)
    return f"restore: {', '.join(parts)} ms; template and tokens {prompt:.0f} ms; {ttft:.0f} ms"


def page(result: dict[str, Any], command: str, machine: dict[str, object]) -> str:
    """The result as the markdown page ``--write-docs`` writes."""
    times, reuse = result["seconds"], result["requests"]
    loads = result["load_1min"]
    lines = [
        "# A sliding-window model through `localkv serve`, beside llama-server",
        "",
        "<!-- Generated by `benchmarks/swa_followup.py --write-docs`; do not edit by hand. -->",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by:",
        "",
        f"```\n{command}\n```",
        "",
        f"- machine: {machine.get('cpu')}, {machine.get('cores')} cores; {machine.get('os')}",
        f"- load average (1 min) before the runs: {min(loads):.2f}-{max(loads):.2f}",
        f"- model: {Path(result['model']).name}; both servers: n_ctx {result['ctx']}, "
        f"{result['threads']} threads, chat format `gemma` (llama-server `--no-jinja`), "
        f"greedy, 8 tokens an answer; {result['runs']} runs a scene, the servers "
        "interleaved; cells are median (min-max) of the time to the first content chunk, "
        "as the client saw it",
        "- scenes: `followup`, one system prompt of about "
        f"{result['tokens']:,} tokens and a new question after it each run; `alternate`, "
        "two such documents in turn (A, B, A, B), each with a new question",
        "",
        "| scene | localkv | llama-server | localkv / llama-server | target | prompt tokens "
        "(localkv; llama-server) | cached tokens (localkv; llama-server) |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    notes = []
    for scene in ("followup", "alternate"):
        ours, peer = times["localkv"][scene], times["llama-server"][scene]
        ratio = statistics.median(ours) / statistics.median(peer)
        met = "met" if ratio <= TARGET else "not met"
        by = {k: [r for r in reuse[scene] if r["server"] == k] for k in ("localkv", "llama-server")}

        def seen(key: str, by: dict[str, list[dict[str, Any]]] = by) -> str:
            return "; ".join(
                ", ".join(str(v) for v in sorted({r.get(key) for r in rows}, key=str))
                for rows in by.values()
            )

        lines.append(
            f"| {scene} | {_cell(ours)} | {_cell(peer)} | {ratio:.2f}x | <= {TARGET}x "
            f"({met}) | {seen('prompt_tokens')} | {seen('cached')} |"
        )
        sources = ", ".join(sorted({str(r.get("source")) for r in by["localkv"]}))
        notes.append(
            f"- {scene}, localkv (from {sources}; the server's own medians): "
            f"{_steps(by['localkv'])} to the first token."
        )
    lines += [
        "",
        "Where localkv's time goes, by its own figures (`localkv` in each response):",
        "",
        *notes,
        "",
        "With Gemma's format the system prompt sits inside the first user turn, and a "
        "sliding window cannot be cut back: a new question goes back to the state where the "
        "system text ends (`localkv/prompt/`). The first time in a process that state is "
        "restored from the disk and its probe decoded (the stored chain's last token, whose "
        "logits verify it); after that, the state that restore left is resumed from memory "
        "(`source` memory: `localkv/cache/restore/held.py`), with no read and no probe. Then "
        "the question's tokens are computed, the last of them alone (so the prompt's end is "
        "stored with a probe of its own). llama-server keeps the prompt's state in memory "
        "(its context checkpoints) and computes the question in one "
        "batch. `alternate` is where llama-server re-prefills from its last checkpoint.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: Gemma 3 270M)")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama-server binary")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--localkv-only", action="store_true", help="no llama-server")
    parser.add_argument("--write-json", type=Path, default=None)
    parser.add_argument(
        "--write-docs", type=Path, default=None, help="write the page (and its JSON beside it)"
    )
    args = parser.parse_args()
    if args.model is None:
        from support.gemma import gemma3_270m

        args.model = gemma3_270m()
    peer = None if args.localkv_only else args.llama_server or LLAMA_SERVER
    if peer is not None and not peer.exists():
        raise SystemExit(f"no llama-server at {peer} (--llama-server PATH, or --localkv-only)")
    if args.write_docs is not None and peer is None:
        raise SystemExit("--write-docs compares with llama-server: drop --localkv-only")
    result = measure(
        model=args.model,
        threads=args.threads,
        ctx=args.ctx,
        n_tokens=args.tokens,
        runs=args.runs,
        llama_server=peer,
    )
    print(table(result))
    if args.write_json is not None:
        args.write_json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.write_docs is not None:
        from localkv.bench.run import describe_machine

        command = "python benchmarks/swa_followup.py " + " ".join(sys.argv[1:])
        args.write_docs.write_text(page(result, command, describe_machine()), encoding="utf-8")
        data = args.write_docs.with_suffix(".json")
        data.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
