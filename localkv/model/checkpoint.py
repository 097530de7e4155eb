"""A session's sequence as it stood, to stand there again: llama.cpp's state and the rest.

``ModelSession.checkpoint()`` takes one, ``ModelSession.resume(checkpoint)`` puts
the session back to it. The state is llama.cpp's own (``llama_state_seq_get_data``,
every cell with its position), loaded back whole into an emptied sequence, so
the cells land where they were (from the first on); beside it go what the
session knows of those cells: its tokens, the batches they were decoded in, the
probes and partial parts it kept, an SWA session's window rows being collected
and where it last settled, and the logits after its last token. A resumed
session decodes on exactly as the one checkpointed would have.

A checkpoint belongs to the process and the context that took it: it is never
written anywhere, and it is resumed only into a session of the same context
(``ModelSession.resume`` refuses another's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from localkv.kv.windows import WindowLog

__all__ = ["Checkpoint"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """Sequence 0 of one context as it stood (see the module)."""

    context: int  # the llama.cpp context it was taken from (its address)
    state: np.ndarray  # llama.cpp's state of sequence 0, as it captures it
    tokens: tuple[int, ...]
    batch_ends: tuple[int, ...]
    probes: dict[int, np.ndarray]
    partials: dict[int, np.ndarray]
    windows: WindowLog
    settled_at: int | None
    last_logits: np.ndarray | None

    @property
    def nbytes(self) -> int:
        """The memory it holds (its state, logits, probes and parts; not the small rest)."""
        arrays = [self.state, *self.probes.values(), *self.partials.values()]
        if self.last_logits is not None:
            arrays.append(self.last_logits)
        return sum(a.nbytes for a in arrays) + self.windows.nbytes
