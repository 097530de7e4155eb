"""A model and context opened ahead of need, for the session that asks for the same one.

The command line opens the model it will need in a thread while the rest of
it loads (``localkv.cli.early``: ``open_early``); the session then opens its
model through ``open_model``, which takes that context when the configuration
is the same (the chat template aside) and otherwise frees it and opens its own
(``localkv.model.loading.open_native``). The early open also decodes the
layout probe's first token and reads the state (``Native.probed``), so that
decode runs beside the command line's imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import replace
from typing import Any

from localkv.model.config import SessionConfig
from localkv.model.loading import Native, open_native
from localkv.model.native import ensure_backend, llama_cpp

__all__ = ["drop_early", "open_early", "open_model", "take_early"]


def open_model(cfg: SessionConfig, stack: contextlib.ExitStack) -> Native:
    """``cfg``'s model and context: the one ``open_early`` opened if it is for ``cfg``,
    else opened now (``loading.open_native``); frees go on ``stack``."""
    return take_early(cfg, stack) or open_native(cfg, stack)


# what ``open_early`` opened: its configuration, the handles, their frees
_early: tuple[SessionConfig, Native, contextlib.ExitStack] | None = None
_early_lock = threading.Lock()


def open_early(cfg: SessionConfig) -> bool:
    """Open ``cfg``'s model and context now, for the next ``open_model`` of ``cfg``.

    What fails here is not reported (False): the command opens the model again
    and says what failed in its own words. Any earlier one not taken is freed.
    """
    global _early
    ensure_backend()
    stack = contextlib.ExitStack()
    try:
        native = open_native(cfg, stack)
        native = replace(native, probed=_probe_early(native))
    except Exception:  # ModelLoadError, an unreadable file: the command reports it
        stack.close()
        return False
    with _early_lock:
        early, _early = _early, (cfg, native, stack)
    if early is not None:
        early[2].close()
    return True


def _probe_early(native: Native) -> tuple[int, Any] | None:
    """Decode what ``cache.identity.probe_kv_layout`` decodes first, and read the state.

    The probe's one decode then runs here, beside the command line's imports,
    not after them. Plain KV memory only (the others' probes read more); the
    sequence is emptied after, as the probe leaves it. None where it fails.
    """
    ctx = native.ctx
    if native.n_seq_max < 2:  # plain KV memory has a second sequence (``open_native``)
        return None
    bos = int(llama_cpp.llama_vocab_bos(native.vocab))
    token = bos if bos >= 0 else 0  # as the probe chooses it
    b = native.batch
    b.n_tokens, b.token[0], b.pos[0], b.n_seq_id[0], b.logits[0] = 1, token, 0, 1, 1
    b.seq_id[0][0] = 0
    try:
        if llama_cpp.llama_decode(ctx, b) != 0:
            return None
        size = int(llama_cpp.llama_state_seq_get_size(ctx, 0))
        raw = (ctypes.c_uint8 * size)()
        if llama_cpp.llama_state_seq_get_data(ctx, raw, size, 0) != size:
            return None
        return token, raw
    finally:
        llama_cpp.llama_memory_clear(native.memory, False)


def drop_early() -> None:
    """Free what ``open_early`` opened and no ``open_model`` took."""
    global _early
    with _early_lock:
        early, _early = _early, None
    if early is not None:
        early[2].close()


def take_early(cfg: SessionConfig, stack: contextlib.ExitStack) -> Native | None:
    """The context ``open_early`` opened, if for exactly ``cfg``; otherwise it is freed.

    Only a context whose sequence is empty is kept there (the layout probe's
    decode emptied again, ``_probe_early``), and only an equal configuration
    takes it (the chat template aside: it only shapes the tokens).
    """
    global _early
    with _early_lock:
        early, _early = _early, None
    if early is None:
        return None
    opened, native, frees = early
    if replace(opened, chat_template=cfg.chat_template) != cfg:
        frees.close()
        return None
    stack.enter_context(frees)
    return native
