"""How sizes, times, cache reports and answers read, in the chat app and in line mode alike.

An answer's reasoning is split from it here for both faces
(``localkv.prompt.reasoning``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from localkv.cache.budgeting import human_size
from localkv.prompt.reasoning import ReasoningSplit, split_reasoning
from localkv.runtime.chatsession import SyncReport, TurnReport

__all__ = [
    "ReasoningSplit",
    "ago",
    "cache_parts",
    "counted",
    "finish_line",
    "human_bytes",
    "id_width",
    "split_reasoning",
    "sync_line",
    "sync_summary",
    "turn_line",
]


def counted(n: int, word: str) -> str:
    """``1 hit``, ``2 hits``, ``0 hits``: a count and its noun, singular for one."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def id_width(ids: Iterable[str]) -> int:
    """The shortest start (at least 8 characters) that names each of ``ids`` uniquely,
    as ``cache ls`` shows snapshot ids: any command that takes an id takes it."""
    ids = list(ids)
    n = 8
    while n < max(map(len, ids), default=0) and len({i[:n] for i in ids}) < len(ids):
        n += 1
    return n


def human_bytes(n: int) -> str:
    """``512 B``, ``4.0 KiB``, ``26.8 MiB``, ``1.2 GiB``: the one size format (``human_size``)."""
    return human_size(n)


def ago(timestamp: float, now: float | None = None) -> str:
    """``just now``, ``5 min ago``, ``3 h ago``, ``2 d ago``."""
    seconds = max(0.0, (time.time() if now is None else now) - timestamp)
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min ago"
    if seconds < 86400:
        return f"{seconds // 3600:.0f} h ago"
    return f"{seconds // 86400:.0f} d ago"


def cache_parts(sync: SyncReport, *, in_turn: bool = False) -> list[str]:
    """The one account of a cache report, for every face and every line that shows one.

    In order: what the cache did (restored, with "(verified)" only when the
    restored blocks were checked, or why it missed), which common tokens were
    recomputed for an exact answer (``CacheReport.exactness``, when any were),
    what was prefilled, the prefill time the restore replaced, and a cancelled
    prefill. ``in_turn`` leaves out what an answer's status line already says or
    need not: the prefill's time is part of its TTFT, and a sequence that was
    already in memory is the usual case between turns. A trivial lookup (less
    than a block: only the template's first tokens) is no hit and no miss: a
    turn says nothing of it, an attach or a resume "not in the cache yet".
    """
    cache = None if sync.trivial else sync.cache
    parts = []
    if sync.trivial and not in_turn:
        parts.append("not in the cache yet")
    elif cache is None:
        if not in_turn:
            parts.append("already in memory" if not sync.prefilled else "earlier tokens in memory")
    elif cache.hit:
        verified = " (verified)" if cache.verified else ""
        parts.append(
            f"restored {cache.reused:,} tokens{verified} in {cache.restore_s * 1000:.0f} ms"
        )
    else:
        parts.append(f"cache miss: {cache.miss_reason}")
    if cache is not None and cache.recomputed:
        parts.append(cache.exactness())
    timed = "" if in_turn else f" in {sync.prefill_s:.2f} s"
    if sync.prefilled or in_turn:  # nothing prefilled: nothing to say
        parts.append(f"prefilled {sync.prefilled:,}{timed}")
    if cache is not None and cache.hit:
        parts.append(f"saved ≈ {cache.saved_s:.1f} s")
    if sync.cancelled:
        parts.append("cancelled")
    return parts


def sync_line(sync: SyncReport) -> str:
    """What bringing the KV sequence in line cost (an attach, a resume): ``cache_parts``."""
    return " · ".join(cache_parts(sync))


def turn_line(turn: TurnReport) -> str:
    """An answer's status line: ``TTFT 0.05 s · 31 tok/s ·`` then ``cache_parts``,
    then why the answer ended when the model did not end it (``finish_line``)."""
    parts = [f"TTFT {turn.ttft_s:.2f} s", f"{turn.tokens_per_s:.0f} tok/s"]
    parts += cache_parts(turn.sync, in_turn=True)
    if turn.stopped:
        parts.append("stopped")
    finish = finish_line(turn.finish_reason, turn.n_ctx)
    if finish:
        parts.append(finish)
    return " · ".join(parts)


def finish_line(reason: str, n_ctx: int) -> str | None:
    """Why an answer ended early: a full context or the token limit (None otherwise)."""
    if reason == "context":
        return f"answer stopped: the context is full ({n_ctx:,} tokens); /new or raise --ctx"
    if reason == "length":
        return "answer stopped at the token limit (--max-tokens)"
    return None


def sync_summary(sync: SyncReport) -> str:
    """The short form line mode puts in a note: restored from the cache, or what was prefilled."""
    if sync.cache is not None and sync.cache.hit:
        return "restored from the cache"
    return f"prefilled {sync.prefilled:,} tokens"
