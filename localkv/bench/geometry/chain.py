"""A stored chain with random K/V rows, made without the prefill's attention.

``synthetic_prefill(session, tokens, ends)`` puts ``tokens`` into the session in
the batches of the request's schedule ``ends`` (``Runtime.schedule``), as a
prefill would, but a batch of two or more tokens is not computed: its cells
are loaded as a sequence state (``codec.assembly``, ``ModelSession.load_state``
appending at its first position) whose K and V rows are random f16 values
(standard normal halves). A token the schedule decodes alone (a block's last,
a segment's last) is decoded by llama.cpp over those cells, so every block end
has its real probe and the session ends with real logits. Saving the session
then (``Runtime.save_prefix``) stores a chain that a verified restore takes
whole: to llama.cpp the loaded rows are as real as computed ones, and restoring
costs the same whatever the values. A prefill at a large model's geometry costs
the square of its length; this costs the state's bytes and one decode per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from localkv.kv.codec import assembly
from localkv.kv.layout import LayerLayout
from localkv.model.session import ModelSession

__all__ = ["synthetic_prefill"]

F16 = 1  # ggml's type id of an f16 K or V row


def _layout(session: ModelSession, token: int) -> tuple[tuple[LayerLayout, ...], bool]:
    """The session's K/V layout and V transposition, from one token decoded then dropped."""
    session.reset()
    session.decode_one(token)
    state = session.capture()
    session.reset()
    layout = state.layout()
    if any(k != F16 or v != F16 for k, _, v, _ in layout):
        raise ValueError("random rows are written for f16 K and V caches only")
    return layout, state.v_trans


def _fill(rows: np.ndarray, rng: np.random.Generator) -> None:
    halves = rows.view(np.float16)
    halves[...] = rng.standard_normal(halves.shape, dtype=np.float32)


def _load_random(
    session: ModelSession,
    tokens: Sequence[int],
    first: int,
    *,
    layout: Sequence[LayerLayout],
    v_trans: bool,
    rng: np.random.Generator,
) -> None:
    """Cells ``first..first+len(tokens)-1`` of ``tokens`` with random rows, after the session's."""
    cell_ext = session.cell_ext
    buf, k_rows, v_rows = assembly(
        layout, len(tokens), first=first, v_trans=v_trans, cell_ext=cell_ext
    )
    for rows in (*k_rows, *v_rows):
        _fill(rows, rng)
    session.load_state(buf, list(tokens), first=first)


def synthetic_prefill(
    session: ModelSession, tokens: Sequence[int], ends: Sequence[int], *, seed: int = 0
) -> None:
    """The empty ``session`` := ``tokens`` in the batches ending at ``ends``, random rows for
    every batch of two or more tokens, every token alone decoded (see the module)."""
    if not tokens or not ends or ends[-1] != len(tokens):
        raise ValueError(f"a schedule of {len(tokens)} tokens must end at {len(tokens)}")
    if session.memory_kind != "kv" or not session.in_pieces:
        kind = session.memory_kind
        raise ValueError(f"random rows are loaded into plain KV memory only, not {kind}")
    rng = np.random.default_rng(seed)
    layout, v_trans = _layout(session, tokens[0])
    pos, done = 0, []
    for stop in ends:
        if stop <= pos:
            continue
        if stop - pos == 1:
            session.prefill(list(tokens[pos:stop]), ends=ends)
        else:
            _load_random(session, tokens[pos:stop], pos, layout=layout, v_trans=v_trans, rng=rng)
        done.append(stop)
        session.batch_ends = list(done)  # the batches they stand for, as a prefill's
        pos = stop
