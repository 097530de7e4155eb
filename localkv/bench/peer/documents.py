"""The requests both servers answer: a document of N tokens as the system prompt, a question.

A document is the bench text (``localkv.bench.text``) cut to exactly N tokens of the
model's vocabulary under a heading that names it; document B starts where A's N
tokens end, so the two share no prefix past the heading. The chat template and the
question add a few dozen tokens; each server reports the prompt's length it saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from localkv.bench.text import prompt_tokens
from localkv.model.session import ModelSession, SessionConfig

__all__ = ["ASK", "documents", "messages", "question"]

SYSTEM = "Answer from the document."
ASK = "Tell the story of the document in detail."  # the cold and the restart request's


def question(i: int) -> str:
    """A question no earlier turn asked, so each turn's prompt ends in tokens of its own."""
    return f"Question {i}: who is in the story, and what do they do?"


def documents(model: Path, n_tokens: int, names: Sequence[str] = ("A",)) -> dict[str, str]:
    """One document of ``n_tokens`` tokens per name, each from its own part of the text."""
    with ModelSession(SessionConfig(model_path=model, n_ctx=512, n_threads=1)) as s:
        tokens = prompt_tokens(s, n_tokens * len(names))
        return {
            name: f"Document {name}.\n\n" + s.detokenize(tokens[i * n_tokens : (i + 1) * n_tokens])
            for i, name in enumerate(names)
        }


def messages(document: str, ask: str) -> list[dict[str, str]]:
    """The chat: the document as the system prompt, then the question."""
    return [
        {"role": "system", "content": f"{SYSTEM}\n\n{document}"},
        {"role": "user", "content": ask},
    ]
