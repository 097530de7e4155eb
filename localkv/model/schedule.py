"""The canonical batch schedule, and how much of a stored computation a request may reuse.

llama.cpp's kernels are not batch-size invariant: the same tokens decoded in
other batches give K/V values (and logits) that differ in the last bits. A
cached state is therefore exactly a request's uncached state only if it was
computed in the same batches. So every writer — prefill, ask, chat, resume,
attach — batches a request by one rule that depends only on the request
(its length, segment ends and any spans decoded token by token, such as a
chat's generated answers), never on how much happened to be restored:

- a token is decoded alone at the end of every block of the grid
  (positions ``B-1, 2B-1, ...``), at the end of every segment, and at the
  end of the request; its logits are a probe;
- the tokens between two of those are one batch (split every ``max_batch``
  tokens, counted from the batch's canonical start, when a block is wider
  than the context's batch);
- every token of a span decoded token by token is a batch of its own.

A batch *end* is the token count after a batch. The chain hash of a block
covers its batch ends, and a restore stops at the last batch end that the
stored computation and the request's own schedule share (``shared_end``).

A sliding-window session *settles* before some tokens it decodes alone
(``model.partial_state``), which changes the numbers after them: where its batch
ends alone do not say so (a segment's last token after a token decoded alone,
as a turn's closing tokens after its answer), the schedule says it with a
batch end repeated: an empty batch, a settle (``settle_marks``). So the hash
covers every settle, and a stored state is reused only by a request that
settles where its writer did.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence

__all__ = ["ends_after", "ends_from", "request_ends", "settle_marks", "shared_end"]


def request_ends(
    n_tokens: int,
    boundaries: Iterable[int],
    block_size: int,
    max_batch: int,
    singles: Iterable[tuple[int, int]] = (),
) -> list[int]:
    """The canonical batch ends of a request of ``n_tokens`` tokens (sorted, last = n).

    ``boundaries`` are segment ends (token counts); ``singles`` are ``(start, end)``
    spans whose tokens are each decoded alone.
    """
    if block_size < 1 or max_batch < 1:
        raise ValueError(f"block_size and max_batch must be positive: {block_size}, {max_batch}")
    if n_tokens <= 0:
        return []
    alone = set(range(block_size - 1, n_tokens, block_size))
    alone.update(b - 1 for b in boundaries if 0 < b <= n_tokens)
    alone.add(n_tokens - 1)
    cuts = {c for p in alone for c in (p, p + 1)}
    for start, end in singles:
        if not 0 <= start <= end <= n_tokens:
            raise ValueError(f"span {start}..{end} is outside the {n_tokens} tokens")
        if end > start:
            cuts.update(range(start, end + 1))
    cuts.discard(0)
    ends: list[int] = []
    prev = 0
    for cut in sorted(cuts):
        ends.extend(range(prev + max_batch, cut, max_batch))
        ends.append(cut)
        prev = cut
    return ends


def settle_marks(ends: Sequence[int], segment_ends: Iterable[int], block_size: int) -> list[int]:
    """``ends`` with an empty batch (its end repeated) before each segment's last token that
    a sliding-window session settles before only by being told (``model.partial_state``).

    The batch ends alone make it settle before a token decoded alone at a block-grid
    end or right after a batch of two or more tokens; a segment that ends otherwise
    (its last two tokens each decoded alone: a turn's closing tokens after the answer,
    a one-token segment) gets the mark, so a restore can end with it as well.
    """
    marks = set()
    for end in segment_ends:
        last = end - 1
        if last < 1 or end % block_size == 0:
            continue
        i = bisect_right(ends, last) - 1  # the batch that ends where the last token starts
        if i >= 0 and ends[i] == last and last - (ends[i - 1] if i else 0) == 1:
            marks.add(last)
    if not marks:
        return list(ends)
    out: list[int] = []
    for e in ends:
        out.append(e)
        if e in marks:
            out.append(e)
    return out


def shared_end(stored: Sequence[int], wanted: Sequence[int], limit: int, start: int = 0) -> int:
    """The last batch end, at most ``limit``, where two computations still agree.

    ``stored`` and ``wanted`` are sorted absolute batch ends after ``start`` (a
    batch end both share). Tokens before the result were computed in the same
    batches in both, so their K/V are the same bits; ``start`` if none is shared.
    """
    agreed = start
    for a, b in zip(stored, wanted, strict=False):
        if a != b or a > limit:
            break
        agreed = a
    return agreed


def ends_after(ends: Sequence[int], start: int) -> list[int]:
    """The batch ends of ``ends`` beyond ``start`` (``ends`` sorted)."""
    return list(ends[bisect_right(ends, start) :])


def ends_from(ends: Sequence[int], start: int) -> list[int]:
    """The batches of ``ends`` still to run from ``start`` on: those beyond it, after any
    empty batch at ``start`` itself (``settle_marks``: the batch ending there is done)."""
    marks = bisect_right(ends, start) - bisect_left(ends, start) - (1 if start else 0)
    return [start] * max(0, marks) + ends_after(ends, start)
