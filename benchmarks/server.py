"""Time to first token over HTTP: ``localkv serve`` beside llama-cpp-python's own server.

    .venv/bin/python benchmarks/server.py [--model PATH] [--tokens 2000 8000] [--threads N]

Needs the peer's extra: ``pip install 'llama-cpp-python[server]==0.3.36'``
(fastapi, sse-starlette, starlette-context, pydantic-settings).

For each server, in one run, with the same model, context, thread count and
flash attention (off: the peer's default): start it, stream a chat completion
with a system prompt of about N tokens (the first request), send it again (a
repeat in the same server), restart the server, and send it once more (the
first request after a restart). TTFT is the time from sending the request to
the first content chunk, seen by the client. The peer keeps the last prompt in
its context, so it is fast on a repeat and cold after a restart; localkv
restores from its disk cache after a restart. Prints one table and the ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import llama_cpp

from localkv.bench.text import bench_text
from localkv.model.find import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from faces import stop_server, stream_ttft, wait_ready  # benchmarks/faces.py, beside this file
from support.server import free_port

QUESTION = "Who is sitting by her sister?"


def system_prompt(model: Path, n_tokens: int, tag: str) -> str:
    """About ``n_tokens`` tokens of the bench text, after a heading that sets them apart."""
    vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    tokens = vocab.tokenize(bench_text(n_tokens // 200 + 2).encode(), add_bos=False)
    return f"Notes {tag}.\n\n" + vocab.detokenize(tokens[:n_tokens]).decode("utf-8", "replace")


class Server:
    """One server process (``localkv`` or ``peer``) that can be restarted."""

    def __init__(self, kind: str, model: Path, ctx: int, threads: int, home: Path) -> None:
        self.kind, self.model, self.ctx, self.threads, self.home = kind, model, ctx, threads, home
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        common = [sys.executable, "-m"]
        if self.kind == "localkv":
            return [
                *common,
                "localkv",
                "serve",
                "--model",
                str(self.model),
                "--port",
                str(self.port),
                "--ctx",
                str(self.ctx),
                "--threads",
                str(self.threads),
                "--flash-attn",
                "off",
            ]
        return [
            *common,
            "llama_cpp.server",
            "--model",
            str(self.model),
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--n_ctx",
            str(self.ctx),
            "--n_threads",
            str(self.threads),
            "--n_threads_batch",
            str(self.threads),
        ]

    def start(self) -> None:
        env = {**os.environ, "LOCALKV_HOME": str(self.home)}
        log = (self.home.parent / f"{self.kind}.log").open("ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        path = "/health" if self.kind == "localkv" else "/v1/models"
        url = f"http://127.0.0.1:{self.port}{path}"
        wait_ready(self.proc, url, self.home.parent / f"{self.kind}.log")

    def stop(self) -> None:
        stop_server(self.proc)

    def ttft(self, system: str) -> tuple[float, dict[str, object]]:
        """Seconds to the first content chunk, and the ``localkv`` object (localkv only)."""
        return stream_ttft(self.port, system, QUESTION)


def run(
    kind: str, model: Path, ctx: int, threads: int, prompts: dict[int, str], *, work: Path
) -> dict[str, list[float]]:
    home = work / f"{kind}-home"
    home.mkdir()
    server = Server(kind, model, ctx, threads, home)
    out: dict[str, list[float]] = {}
    server.start()
    try:
        for n, system in prompts.items():
            first, _ = server.ttft(system)
            repeat, info = server.ttft(system)
            out[f"{n}"] = [first, repeat]
            if kind == "localkv":
                print(
                    f"  localkv repeat of {n:,}: source {info.get('source')}, "
                    f"restore {info.get('restore_ms')} ms",
                    file=sys.stderr,
                )
        server.stop()
        server.start()
        for n, system in prompts.items():
            after, info = server.ttft(system)
            out[f"{n}"].append(after)
            if kind == "localkv":
                print(
                    f"  localkv after restart, {n:,}: source {info.get('source')}, "
                    f"verified {info.get('verified')}, restore {info.get('restore_ms')} ms",
                    file=sys.stderr,
                )
    finally:
        server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    model = resolve_model(args.model)
    ctx = (max(args.tokens) + 512 + 255) // 256 * 256
    prompts = {n: system_prompt(model, n, f"set {i}") for i, n in enumerate(args.tokens)}
    work = Path(tempfile.mkdtemp(prefix="lkv-serverbench-"))
    try:
        results = {
            kind: run(kind, model, ctx, args.threads, prompts, work=work)
            for kind in ("localkv", "peer")
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"model {model.name}, n_ctx {ctx}, {args.threads} threads, flash attention off")
    print(f"{'prompt':>8} {'server':>8} {'first':>10} {'repeat':>10} {'restart':>10}")
    for n in args.tokens:
        for kind in ("localkv", "peer"):
            first, repeat, after = results[kind][str(n)]
            ms = "".join(f"{t * 1000:>8.0f}ms" for t in (first, repeat, after))
            print(f"{n:>8,} {kind:>8} {ms}")
        ratio = results["peer"][str(n)][2] / results["localkv"][str(n)][2]
        print(f"{'':>8} after a restart localkv is {ratio:.1f}x faster to the first token")


if __name__ == "__main__":
    main()
