"""What the runtime reports: cache outcome, token counts, timings (public values);
and ``printable``, how every face shows a name it did not write."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Answer", "CacheReport", "PrefillReport", "Timing", "TokenCounts", "printable"]

# C0 and C1 controls and DEL (ESC starts a terminal command), the bidirectional
# overrides and isolates (they reorder what follows), line and paragraph separators
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every control character written as an escape (``\\x1b``, ``\\n``).

    Labels, titles, document and file names come from users, files and HTTP
    clients; a listing shows them on one line and never lets one drive the
    terminal (clear it, move the cursor, retitle the window).
    """
    return _CONTROL.sub(_escape, text)


def _escape(found: re.Match[str]) -> str:
    char = found.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheReport:
    hit: bool
    verified: bool | None
    snapshot: str | None
    miss_reason: str | None
    reused: int
    restore_s: float
    saved_s: float  # estimated prefill seconds the restore replaced
    # tokens the stored chain shares with the request; those past ``reused`` were
    # computed there in other batches, so they are recomputed for an exact answer
    common: int = 0
    # a restore's seconds by step (``RestoreResult.breakdown``: lookup, read, columns,
    # part of read, load, probe); empty when nothing was restored
    steps: Mapping[str, float] = field(default_factory=dict)
    # the state was resumed from one held in memory (``cache.restore.held``), not read
    held: bool = False

    @property
    def first_run(self) -> bool:
        """Nothing was stored for this request ("not cached yet"): no fault, no miss."""
        return (self.miss_reason or "").startswith("not cached yet")

    @property
    def recomputed(self) -> int:
        """Common tokens prefilled again because the stored batches differ from ours."""
        return max(0, self.common - self.reused)

    def exactness(self) -> str:
        """``recomputed 3 common tokens (exact)``: the tokens the stored chain shares but
        computed in other batches; "" when nothing was recomputed."""
        if not self.recomputed:
            return ""
        return f"recomputed {self.recomputed:,} common tokens (exact)"

    def line(self, prompt_tokens: int) -> str:
        """One human line, e.g. ``reused 2,431 of 2,470 tokens (verified) in N ms``."""
        exact = self.exactness()
        if not self.hit and self.first_run:  # the template's first tokens are no news
            return f"{self.miss_reason}; prefilled {prompt_tokens:,} tokens"
        if not self.hit:
            tail = f"; {exact}" if exact else ""
            return f"cache miss ({self.miss_reason}); prefilled {prompt_tokens:,} tokens{tail}"
        line = (
            f"reused {self.reused:,} of {prompt_tokens:,} tokens "
            f"({'verified' if self.verified else 'not verified'}) in "
            f"{self.restore_s * 1000:.0f} ms; saved ≈ {self.saved_s:.1f} s"
        )
        if exact:  # the common tokens stored from other batches were recomputed
            line += f"; {exact}"
        return line


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenCounts:
    prompt: int
    reused: int
    prefilled: int
    generated: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    restore_s: float
    prefill_s: float
    ttft_s: float
    total_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    text: str
    tokens: TokenCounts
    cache: CacheReport
    timing: Timing
    # why the answer ended: "stop" (the model ended it), "length" (max tokens),
    # "context" (the context is full) or "cancelled"
    finish_reason: str = "stop"

    def as_json(self) -> dict[str, object]:
        c = self.cache
        return {
            "answer": self.text,
            "finish_reason": self.finish_reason,
            "tokens": {
                "prompt": self.tokens.prompt,
                "reused": self.tokens.reused,
                "prefilled": self.tokens.prefilled,
                "generated": self.tokens.generated,
            },
            "cache": {
                "hit": c.hit,
                "verified": c.verified,
                "snapshot": c.snapshot,
                "miss_reason": c.miss_reason,
                "common": c.common,
                "recomputed": c.recomputed,
                "saved_s": round(c.saved_s, 6),
            },
            "timing": {
                "restore_s": round(self.timing.restore_s, 6),
                "prefill_s": round(self.timing.prefill_s, 6),
                "ttft_s": round(self.timing.ttft_s, 6),
                "total_s": round(self.timing.total_s, 6),
            },
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillReport:
    snapshot: str | None
    tokens: int
    reused: int
    prefilled: int
    blocks: int
    new_blocks: int
    bytes_on_disk: int
    seconds: float
    cancelled: bool
    cache: CacheReport
    kept: int = 0  # tokens in the cache after the run: what the next run of it restores
    not_kept: str | None = None  # why the budget's eviction took what was just saved
    over_budget: str | None = None  # pinned snapshots hold more than the budget
    not_saved: str | None = None  # why saving failed (disk full, an I/O error); None: it did not

    def as_json(self) -> dict[str, object]:
        return {
            "snapshot": self.snapshot,
            "tokens": self.tokens,
            "reused": self.reused,
            "prefilled": self.prefilled,
            "blocks": self.blocks,
            "new_blocks": self.new_blocks,
            "bytes_on_disk": self.bytes_on_disk,
            "seconds": round(self.seconds, 6),
            "kept": self.kept,
            "cancelled": self.cancelled,
            "not_kept": self.not_kept,
            "over_budget": self.over_budget,
            "not_saved": self.not_saved,
        }
