"""What exactness costs: a request that diverges from a stored document mid-block.

    .venv/bin/python benchmarks/divergence.py [--model PATH] [--tokens 2048] [--repeats 3]

A document of about ``--tokens`` tokens is prefilled and saved; then, in the
same process, the same question is asked over the document as stored and over
copies changed at several places. The reuse ends at the last batch end that
the stored computation and the request's own schedule share (at most one
block before the change), so up to a block of common tokens is prefilled
again. Prints, for each place: the common tokens, the tokens reused, those
recomputed, and the time to the first token (median of ``--repeats``), next to
the cold prefill and the unchanged document's warm restore. Uses the public
API only.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from localkv.bench.text import prompt_tokens
from localkv.model.sampling import SamplingParams
from localkv.prompt.request import Document
from localkv.runtime import Runtime

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)
QUESTION = "What happens next?"


def _ttft(rt: Runtime, docs: list[Document]) -> tuple[float, int, int]:
    """Median TTFT of one ask per document, with the last one's reused and common tokens."""
    times = []
    reused = common = 0
    for doc in docs:
        answer = rt.ask([doc], QUESTION, params=ONE_TOKEN)
        rt.wait_for_saves()
        times.append(answer.timing.ttft_s)
        reused = answer.tokens.reused
        common = getattr(answer.cache, "common", reused)  # older trees report reused only
    return statistics.median(times), reused, common


def _changed(rt: Runtime, doc: Document, token: int, repeats: int) -> list[Document]:
    """Copies of ``doc`` changed just after its first ``token`` tokens, each differently
    (so no copy finds another's blocks past the change)."""
    ids = rt.session.tokenize(doc.text)
    head = rt.session.detokenize(ids[:token])
    tail = doc.text[len(head) :]
    return [
        Document.from_text(f"{head} Zebra{i}{tail}", f"changed-{token}-{i}") for i in range(repeats)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as cache,
        Runtime.open(args.model, cache_dir=cache, n_ctx=args.tokens + 512) as rt,
    ):
        ids = prompt_tokens(rt.session, args.tokens)
        doc = Document.from_text(rt.session.detokenize(ids), "doc.txt")
        t0 = time.perf_counter()
        report = rt.prefill([doc])
        cold = time.perf_counter() - t0
        warm, reused, _ = _ttft(rt, [doc] * args.repeats)
        print(f"document: {report.tokens:,} tokens; cold prefill {cold:.2f} s")
        print(f"unchanged: reused {reused:,}, warm TTFT {warm * 1000:.0f} ms")
        print("| changed after token | common | reused | recomputed | TTFT | TTFT / unchanged |")
        print("|---|---|---|---|---|---|")
        for token in (300, 700, 1000, 1500, 1900):
            if token >= report.tokens - 16:
                continue
            ttft, reused, common = _ttft(rt, _changed(rt, doc, token, args.repeats))
            print(
                f"| {token:,} | {common:,} | {reused:,} | {common - reused:,} | "
                f"{ttft * 1000:.0f} ms | {ttft / warm:.1f}x |"
            )


if __name__ == "__main__":
    main()
