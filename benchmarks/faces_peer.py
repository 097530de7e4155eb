"""The peer of ``benchmarks/faces.py``: llama-cpp-python alone, with llama.cpp's own state files.

Runs in any Python that has ``llama_cpp`` (it imports nothing of localkv):

    python benchmarks/faces_peer.py save  PROMPTS.json          # one state file per document
    python benchmarks/faces_peer.py ask   PROMPTS.json DOC I    # a fresh process: load, answer
    python benchmarks/faces_peer.py api   PROMPTS.json RUNS K   # one process, alternating loads

``PROMPTS.json`` (written by ``faces.py``) holds the model, n_ctx, threads, flash
attention and, per document, the prefix's token ids (what localkv restores) and
the token ids of each question after it. ``ask`` loads the model, loads the
document's ``llama_state_seq_load_file`` into sequence 0, decodes the question's
tokens and writes each greedy token's text to stdout as it comes (the first byte
is the first token, as for ``localkv ask``). ``api`` prints one JSON line: the
seconds from the start of each load to the first token's logits.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np


def _open(p: dict[str, Any]) -> llama_cpp.Llama:
    return llama_cpp.Llama(
        p["model"],
        n_ctx=p["n_ctx"],
        n_threads=p["threads"],
        n_threads_batch=p["threads"],
        flash_attn=p["flash_attn"],
        verbose=False,
    )


def _state(p: dict[str, Any], doc: str) -> Path:
    return Path(p["work"]) / f"peer-{doc}.bin"


def save(p: dict[str, Any]) -> None:
    llm = _open(p)
    for doc, d in p["docs"].items():
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(d["prefix"])
        n = len(d["prefix"])
        arr = (llama_cpp.llama_token * n)(*d["prefix"])
        ctx = llm._ctx.ctx
        if not llama_cpp.llama_state_seq_save_file(ctx, str(_state(p, doc)).encode(), 0, arr, n):
            raise SystemExit(f"llama_state_seq_save_file failed for {doc}")


def _load(llm: llama_cpp.Llama, p: dict[str, Any], doc: str) -> int:
    """The document's prefix back in sequence 0 from its state file; its length."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    prefix = p["docs"][doc]["prefix"]
    n = len(prefix)
    out = (llama_cpp.llama_token * n)()
    got = ctypes.c_size_t(0)
    path = str(_state(p, doc)).encode()
    if not llama_cpp.llama_state_seq_load_file(llm._ctx.ctx, path, 0, out, n, ctypes.byref(got)):
        raise SystemExit(f"llama_state_seq_load_file failed for {doc}")
    llm.input_ids[:n] = prefix
    llm.n_tokens = n
    return n


def _greedy(llm: llama_cpp.Llama) -> int:
    """The most likely next token, from the last decoded position's logits."""
    logits = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))


def ask(p: dict[str, Any], doc: str, i: int) -> None:
    llm = _open(p)
    _load(llm, p, doc)
    llm.eval(p["docs"][doc]["questions"][i])
    out = sys.stdout.buffer
    for _ in range(p["max_tokens"]):
        token = _greedy(llm)
        if token == llm.token_eos():
            break
        out.write(llm.detokenize([token]))
        out.flush()
        llm.eval([token])
    out.write(b"\n")


def api(p: dict[str, Any], runs: int, base: int) -> None:
    llm = _open(p)
    docs = sorted(p["docs"])
    seconds = []
    for i in range(runs):
        doc = docs[i % len(docs)]
        t0 = time.perf_counter()
        _load(llm, p, doc)
        llm.eval(p["docs"][doc]["questions"][base + i])
        _greedy(llm)
        seconds.append(time.perf_counter() - t0)
    print(json.dumps({"ttft_s": seconds}))


def main() -> None:
    what, path, *rest = sys.argv[1:]
    p = json.loads(Path(path).read_text())
    if what == "save":
        save(p)
    elif what == "ask":
        ask(p, rest[0], int(rest[1]))
    elif what == "api":
        api(p, int(rest[0]), int(rest[1]))
    else:
        raise SystemExit(f"unknown command {what!r}")


if __name__ == "__main__":
    main()
