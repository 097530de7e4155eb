"""Which settings change llama.cpp's numbers: the facts the cache identity stands on.

    .venv/bin/python benchmarks/numerics.py [--model PATH]

Prints, for flash attention off and on (default model unless --model):

1. thread count: a state restored into a session with another thread count (or
   n_ctx, or n_batch), then one token decoded alone, against the same decode in
   the session that computed the state (max |logit difference|; 0 = bit-identical);
2. batching: a state sliced at k tokens then one decode, against a plain prefill
   of the k tokens then the same decode. Non-zero means K/V depend on the batch
   a token was computed in, which is why localkv batches only at block and
   segment boundaries.
"""

from __future__ import annotations

import argparse

import numpy as np

from localkv.bench.text import bench_text
from localkv.model.find import resolve_model
from localkv.model.session import ModelSession, SessionConfig


def thread_and_context(model: str, flash: str, tokens: list[int]) -> None:
    base = SessionConfig(model_path=resolve_model(model), n_ctx=2048, n_threads=1, flash_attn=flash)
    n = len(tokens)
    with ModelSession(base) as a:
        a.prefill(tokens[: n - 1], boundaries=[n - 1])
        state = a.capture()
        reference = a.decode_one(tokens[n - 1])
    for change in ({"n_threads": 2}, {"n_ctx": 4096}, {"n_batch": 128}):
        cfg = SessionConfig(
            model_path=resolve_model(model),
            n_ctx=int(change.get("n_ctx", 2048)),
            n_threads=int(change.get("n_threads", 1)),
            n_batch=int(change.get("n_batch", 512)),
            flash_attn=flash,
        )
        with ModelSession(cfg) as b:
            b.restore(state, tokens[: n - 1])
            again = b.decode_one(tokens[n - 1])
        print(f"flash {flash:3}  {change!s:20} max |diff| {np.abs(again - reference).max():.4g}")


def batching(model: str, flash: str, tokens: list[int]) -> None:
    cfg = SessionConfig(model_path=resolve_model(model), n_ctx=2048, flash_attn=flash)
    with ModelSession(cfg) as s:
        s.prefill(tokens)
        full = s.capture()
        diffs = []
        for k in (5, 40, 100, 255, 256, 257, 300, 511, 600):
            s.restore(full.slice(0, k), tokens[:k])
            restored = s.decode_one(tokens[k])
            s.reset()
            s.prefill(tokens[:k])
            plain = s.decode_one(tokens[k])
            diffs.append(f"k={k}: {np.abs(restored - plain).max():.3g}")
    print(f"flash {flash:3}  slice vs prefill  " + ", ".join(diffs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    with ModelSession(SessionConfig(model_path=resolve_model(args.model), n_ctx=2048)) as s:
        tokens = s.tokenize(bench_text(20))[:700]
    for flash in ("off", "on"):
        thread_and_context(args.model, flash, tokens[:600])
        batching(args.model, flash, tokens)


if __name__ == "__main__":
    main()
