"""A personal RAG loop on localkv: pick document chunks, ask, reuse the cache across runs.

    python examples/rag_loop.py NOTES_DIR "What did I decide about the garden?"

Chunks are picked by simple word overlap and then put in a stable order (file,
then position), so questions that touch the same chunks build the same prefix
and the second run restores it from disk instead of prefilling it again.
Run it twice and compare the cache line it prints.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import localkv

SYSTEM = "Answer the question using only the notes. Say so if the notes do not tell."
CHUNK_CHARS = 1500
TOP_K = 3


def chunks(folder: Path) -> list[localkv.Document]:
    """Every text file cut into fixed-size chunks, named file#index."""
    out = []
    for path in sorted(folder.rglob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        for i in range(0, len(text), CHUNK_CHARS):
            piece = text[i : i + CHUNK_CHARS]
            if piece.strip():
                out.append(localkv.Document.from_text(piece, f"{path.name}#{i // CHUNK_CHARS}"))
    return out


def words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]{4,}", text.lower())}


def pick(candidates: list[localkv.Document], question: str) -> list[localkv.Document]:
    """The TOP_K chunks sharing most words with the question, in a stable order."""
    q = words(question)
    ranked = sorted(candidates, key=lambda d: len(q & words(d.text)), reverse=True)[:TOP_K]
    return sorted(ranked, key=lambda d: candidates.index(d))


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    folder, question = Path(sys.argv[1]), sys.argv[2]
    chosen = pick(chunks(folder), question)
    if not chosen:
        print(f"no .txt files in {folder}")
        return 1
    print("using:", ", ".join(d.name for d in chosen), file=sys.stderr)
    with localkv.Runtime.open(n_ctx=4096) as rt:
        answer = rt.ask(
            chosen,
            question,
            system=SYSTEM,
            params=localkv.SamplingParams(temperature=0, max_tokens=200),
            on_text=lambda piece: print(piece, end="", flush=True),
        )
    print()
    print(answer.cache.line(answer.tokens.prompt), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
