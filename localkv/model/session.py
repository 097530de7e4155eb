"""A loaded model with one KV sequence: tokenize, prefill, generate, capture, restore.

The session owns its native handles (model, context, batch, LoRA adapters) through an
``ExitStack``; ``close()`` frees them once. Decodes use the free cores (``threads.ThreadFit``).

Prefill follows the request's canonical batch schedule (``localkv.model.schedule``): positions are
0..n-1 of sequence 0; the last token of every block, segment and request is decoded alone. The
logits of a token decoded alone are that position's probe: restoring the state of the tokens before
it and decoding it alone reproduces them bit for bit. ``batch_ends`` records how the sequence was
actually batched; the cache keys blocks by it. ``generate`` samples with llama.cpp's sampler chain
(``model.sampling``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Literal

import numpy as np

from localkv.kv import codec
from localkv.kv.windows import WindowLog
from localkv.model.checkpoint import Checkpoint
from localkv.model.config import LoraSpec, SessionConfig
from localkv.model.loading import ModelLoadError, Native, open_native
from localkv.model.native import ensure_backend, llama_cpp
from localkv.model.partial_state import (
    attention_state,
    memory_of,
    partial_after,
    partial_before,
    settle_at,
    window_of,
)
from localkv.model.sampling import Sampler, SamplingParams
from localkv.model.schedule import ends_from, request_ends, settle_marks
from localkv.model.state import (
    ContextFullError,
    PrefillCancelled,
    PrefillResult,
    append_state,
    cell_ext_of,
    check_cells,
    large_buffer,
    read_state,
    write_state,
)
from localkv.model.threads import ThreadFit
from localkv.model.vocab import token_piece, tokenize

__all__ = [
    "ContextFullError",
    "LoraSpec",
    "ModelLoadError",
    "ModelSession",
    "PrefillCancelled",
    "SessionConfig",
]

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]
CancelFn = Callable[[], bool]
FinishReason = Literal["stop", "length", "context", "cancelled"]


class ModelSession:
    """One model, one context, one KV sequence (id 0)."""

    def __init__(self, config: SessionConfig) -> None:
        ensure_backend()
        self.config = config
        self._stack = contextlib.ExitStack()
        self.tokens: list[int] = []
        self._last_logits: np.ndarray | None = None
        # logits of tokens decoded alone at block ends and boundaries: the probes;
        # partial states by position; SWA: the sliding rows blocks will store
        # (``kv.windows``), the last settle's position (``model.partial_state``)
        self.probes: dict[int, np.ndarray] = {}
        self.partials: dict[int, np.ndarray] = {}
        self.windows = WindowLog()
        self.settled_at: int | None = None
        self.segment_ends: set[int] = set()
        self.snapshot_interval = config.block_size
        self._scratch: np.ndarray | None = None  # reused restore buffer
        # token counts after each llama_decode call: how the sequence was batched.
        # Numerics depend on batching, so a faithful recomputation replays it.
        self.batch_ends: list[int] = []
        # tokens ending an answer besides end-of-generation: the turn's end (``ChatTemplate``)
        self.stop_tokens: set[int] = set()
        try:
            self._open()
        except BaseException:
            self._stack.close()
            raise

    # ----------------------------------------------------------------- setup
    def _open(self) -> None:
        native = open_native(self.config, self._stack)
        self.model, self.vocab, self.n_vocab = native.model, native.vocab, native.n_vocab
        self.n_threads, self._flash_attn = native.n_threads, native.flash_attn
        self.threads = _fit_threads(native, self.config)  # fitted to the free cores
        self.ctx, self.memory, self._batch = native.ctx, native.memory, native.batch
        self.n_ctx, self.n_batch = native.n_ctx, native.n_batch
        self.offload = native.offload  # where the layers compute (the identity names it)
        self.in_pieces = native.n_seq_max > 1  # a state may be loaded a piece at a time
        self.memory_kind, self.memory_refusal = memory_of(self.model)
        self.swa_window = int(llama_cpp.llama_model_n_swa(self.model))
        self.cell_ext = cell_ext_of(self.model, self.memory_kind)  # cells name their tokens

    def flash_attn_setting(self) -> str:  # what llama.cpp got (``loading.flash_attn_setting``)
        return self._flash_attn

    def close(self) -> None:  # free the native handles (idempotent)
        self._stack.close()

    def __enter__(self) -> ModelSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- metadata
    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None when the model lacks it."""
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else None

    def n_layer(self) -> int:
        return int(llama_cpp.llama_model_n_layer(self.model))

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self.model, buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    # ---------------------------------------------------------- tokenization
    def tokenize(
        self, text: str, *, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        return tokenize(self.vocab, text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        return token_piece(self.vocab, token, special=special)

    def detokenize(self, tokens: Iterable[int], *, special: bool = False) -> str:
        data = b"".join(self.token_bytes(t, special=special) for t in tokens)
        return data.decode("utf-8", errors="replace")

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def bos_token(self) -> int | None:
        return tok if (tok := int(llama_cpp.llama_vocab_bos(self.vocab))) >= 0 else None

    # --------------------------------------------------------------- decoding
    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def last_logits(self) -> np.ndarray | None:
        """Logits after the last token decoded (None after a restore or reset)."""
        return self._last_logits

    def _decode(self, tokens: list[int], want_last: bool) -> np.ndarray | None:
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise ValueError(f"batch of {n} tokens (limit {self.n_batch})")
        start = len(self.tokens)
        if start + n > self.n_ctx:
            raise ContextFullError(start + n, self.n_ctx)
        b = self._batch
        b.n_tokens = n
        for i, tok in enumerate(tokens):
            b.token[i] = tok
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 0
        b.logits[n - 1] = int(want_last)
        self.threads.check()
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with status {rc}")
        self.tokens.extend(tokens)
        self.batch_ends.append(len(self.tokens))
        if not want_last:
            self._last_logits = None
            return None
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, n - 1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
        self._last_logits = logits
        return logits

    def decode_one(self, token: int, *, probe: bool = False) -> np.ndarray:
        """Decode one token alone next and return its logits.

        They are kept as a probe when ``probe`` is set or the token ends a block."""
        pos = len(self.tokens)
        partial_before(self, pos)
        logits = self._decode([token], want_last=True)
        if logits is None:  # pragma: no cover - want_last guarantees logits
            raise RuntimeError("no logits")
        partial_after(self, pos)
        if probe or (pos + 1) % self.config.block_size == 0:
            self.probes[pos] = logits
        return logits

    def schedule(
        self, n_tokens: int, boundaries: Iterable[int], singles: Iterable[tuple[int, int]] = ()
    ) -> list[int]:
        """The canonical batch ends of a request (``model.schedule``); notes its segment ends."""
        boundaries = list(boundaries)
        self.segment_ends = {b for b in boundaries if b > 0} | {n_tokens}
        block = self.config.block_size
        ends = request_ends(n_tokens, boundaries, block, min(self.n_batch, block), singles)
        if self.memory_kind == "swa":  # every segment end is a settle (``model.partial_state``)
            return settle_marks(ends, self.segment_ends, block)
        return ends

    def prefill(
        self,
        tokens: list[int],
        *,
        ends: Sequence[int] | None = None,
        boundaries: Iterable[int] = (),
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
    ) -> PrefillResult:
        """Append ``tokens`` to the sequence, in the batches that end at ``ends``.

        ``ends`` is the request's whole schedule (absolute batch ends, see
        ``schedule``; default: the schedule of a request that ends with
        ``tokens`` and has segments ending at ``boundaries``). The sequence must
        stand at one of them (or be empty) and the end of ``tokens`` is one. A
        token decoded alone keeps its logits as a probe where a block can end
        after it.
        ``progress(done, total)`` is called after each batch; when ``cancel()``
        turns true, prefill stops between batches and raises ``PrefillCancelled``.
        """
        start = len(self.tokens)
        end = start + len(tokens)
        if end > self.n_ctx:
            raise ContextFullError(end, self.n_ctx)
        result = PrefillResult(start, end)
        if end == start:
            return result
        if ends is None:
            ends = self.schedule(end, boundaries)
        if (start and start not in ends) or end not in ends:
            raise ValueError(f"tokens {start}..{end} do not start and end at batch ends")
        batches = ends_from(ends, start)
        batches = batches[: batches.index(end) + 1]
        pos = start
        for i, stop in enumerate(batches):
            if cancel is not None and cancel():
                raise PrefillCancelled(pos - start)
            if stop == pos:  # an empty batch: settle here (``schedule.settle_marks``)
                self._settle_mark(pos)
                continue
            if stop - pos > self.n_batch:
                raise ValueError(f"batch of {stop - pos} tokens (limit {self.n_batch})")
            if stop - pos == 1:
                single_next = i + 1 < len(batches) and batches[i + 1] - stop == 1
                keep = not single_next or stop % self.config.block_size == 0
                logits = self.decode_one(tokens[pos - start], probe=keep)
                if keep:
                    result.probes[pos] = logits
            else:
                self._decode(tokens[pos - start : stop - start], want_last=False)
            pos = stop
            if progress is not None:
                progress(pos - start, end - start)
        return result

    def _settle_mark(self, pos: int) -> None:
        """The schedule's empty batch at ``pos``: an SWA session settles (once)."""
        if self.batch_ends[-2:] == [pos, pos]:
            return
        if self.memory_kind == "swa":
            settle_at(self, pos)
        self.batch_ends.append(pos)

    def generate(
        self,
        params: SamplingParams,
        *,
        cancel: CancelFn | None = None,
    ) -> Generator[int, None, FinishReason]:
        """Sample tokens after the current sequence until the answer ends.

        Yields each token id as sampled; the token is in the sequence when the
        next one is requested. Returns why it ended: "stop" at an
        end-of-generation token or one of ``stop_tokens`` (neither is yielded),
        "length" after ``params.max_tokens``, "context" when the context is
        full, "cancelled" when ``cancel()`` turned true.
        """
        logits = self._last_logits
        if logits is None:
            raise RuntimeError("generate needs the logits of the last token: prefill first")
        with Sampler(params, self.vocab, self.n_vocab, self.tokens) as sampler:
            for _ in range(params.max_tokens):
                if cancel is not None and cancel():
                    return "cancelled"
                token = sampler.sample(logits)  # None: the grammar allows nothing more
                if token is None or token in self.stop_tokens or self.is_end_of_generation(token):
                    return "stop"
                sampler.accept(token)
                yield token
                if len(self.tokens) >= self.n_ctx:
                    return "context"
                logits = self.decode_one(token)
        return "length"

    # ------------------------------------------------------------------ state
    def capture_state(self) -> bytes:
        return self.capture_array().tobytes()  # the raw state of sequence 0

    def capture_array(self) -> np.ndarray:
        """The raw llama.cpp state of sequence 0, written straight into a new uint8 array."""
        return read_state(self.ctx)

    def capture(self) -> codec.KVState:
        """The parsed state of sequence 0 (raises ``StateFormatError`` if unknown).

        Its K/V rows view one capture buffer, no copy (SWA, hybrid: the attention part;
        an SWA window's rows go to the blocks still collecting them, ``windows``).
        """
        state = self.capture_array()
        if self.memory_kind == "swa":
            self.windows.harvest(window_of(state))
        return check_cells(attention_state(state, self.memory_kind), self.tokens, self.cell_ext)

    def load_state(
        self,
        data: bytes | bytearray | np.ndarray,
        tokens: list[int],
        *,
        first: int = 0,
        named: bool = False,
    ) -> None:
        """Sequence 0 := a raw state of ``tokens`` at 0..n-1 (``first``: added at ``first``..).

        Where cells name their tokens, they are written into ``data`` first, unless it
        is ``named`` already (then it may be read-only: nothing is written into it)."""
        if first and (not self.in_pieces or first != len(self.tokens)):
            raise ValueError(f"cannot add a state at {first} to {len(self.tokens)} tokens")
        if not first:
            self.reset()
        if first + len(tokens) > self.n_ctx:
            raise ContextFullError(first + len(tokens), self.n_ctx)
        cells = tokens if self.cell_ext and not named else None
        try:
            if first:
                append_state(self.ctx, self.memory, data, cells)  # type: ignore[arg-type]
            else:
                write_state(self.ctx, data, cells)
        except codec.StateFormatError:
            self.reset()
            raise
        self.tokens = [*self.tokens[:first], *tokens]
        self.batch_ends = [len(self.tokens)]  # as far as this process knows

    @property
    def _context_id(self) -> int:
        """The llama.cpp context's address: which context a checkpoint came from."""
        return int(ctypes.cast(self.ctx, ctypes.c_void_p).value or 0)

    def state_bytes(self) -> int:
        """The size of sequence 0's raw state (what ``capture_array`` would write)."""
        return int(llama_cpp.llama_state_seq_get_size(self.ctx, 0))

    def checkpoint(self) -> Checkpoint:
        """Sequence 0 as it stands now, to ``resume`` (``model.checkpoint``)."""
        return Checkpoint(
            context=self._context_id,
            state=self.capture_array(),
            tokens=tuple(self.tokens),
            batch_ends=tuple(self.batch_ends),
            probes=dict(self.probes),
            partials=dict(self.partials),
            windows=self.windows.copy(),
            settled_at=self.settled_at,
            last_logits=None if self._last_logits is None else self._last_logits.copy(),
        )

    def resume(self, checkpoint: Checkpoint) -> None:
        """Put sequence 0 back as ``checkpoint`` (taken from this context) found it.
        ``StateFormatError`` (the sequence emptied) where llama.cpp refuses its state."""
        if checkpoint.context != self._context_id:
            raise ValueError("a checkpoint resumes only in the context that took it")
        self.load_state(checkpoint.state, list(checkpoint.tokens), named=True)
        self.batch_ends = list(checkpoint.batch_ends)
        self.probes, self.partials = dict(checkpoint.probes), dict(checkpoint.partials)
        self.windows = checkpoint.windows.copy()
        self.settled_at = checkpoint.settled_at
        last = checkpoint.last_logits
        self._last_logits = None if last is None else last.copy()

    def restore(self, state: codec.KVState | Sequence[codec.KVState], tokens: list[int]) -> None:
        """Load a parsed state, or consecutive pieces of one, holding ``tokens`` at 0..n-1."""
        parts = [state] if isinstance(state, codec.KVState) else list(state)
        n = len(tokens)
        positions = np.concatenate([p.positions for p in parts])[:n]
        if positions.shape[0] != n or not np.array_equal(positions, np.arange(n)):
            raise codec.StateFormatError("state positions are not 0..n-1")
        scratch = self._scratch_for(codec.assembled_size(parts, n, self.cell_ext), n)
        buf = codec.assemble(parts, n_tokens=n, scratch=scratch, cell_ext=self.cell_ext)
        self.load_state(buf, tokens)

    def restore_buffer(
        self, layout: Sequence[codec.LayerLayout], n: int, tail: int = 0, v_trans: bool = False
    ) -> codec.Assembly:
        """``codec.assembly`` of ``n`` tokens in reused scratch, then ``tail`` bytes (partial)."""
        size = codec.state_size(layout, v_trans, n, self.cell_ext)
        scratch = self._scratch_for(size, n, tail)
        ext, trans = self.cell_ext, v_trans
        _, k_rows, v_rows = codec.assembly(layout, n, scratch=scratch, cell_ext=ext, v_trans=trans)
        return codec.Assembly(scratch[: size + tail], k_rows, v_rows)

    def _scratch_for(self, size: int, n: int, tail: int = 0) -> np.ndarray:
        if self._scratch is None or self._scratch.shape[0] < size + tail:
            # room for the whole context, so later restores reuse the same pages
            per_token = max(1, size // max(1, n))
            self._scratch = large_buffer(max(size, per_token * self.n_ctx + 4096) + tail)
        return self._scratch

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens of the sequence."""
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"cannot keep {n} of {len(self.tokens)} tokens")
        if n == len(self.tokens):
            return
        if self.memory_kind != "kv":  # cannot be cut (model.partial_state): emptied instead
            self.reset()
            return
        if not llama_cpp.llama_memory_seq_rm(self.memory, 0, n, -1):
            raise RuntimeError("llama.cpp could not trim the sequence")
        del self.tokens[n:]
        self.probes = {p: x for p, x in self.probes.items() if p < n}
        self.batch_ends = [e for e in self.batch_ends if e < n] + [n]
        self._last_logits = None

    def reset(self) -> None:
        """Empty the sequence."""
        # metadata only: zeroing the whole KV buffer costs milliseconds per call, and
        # freed cells are masked out (llama.cpp's own seq_rm does not zero them either)
        llama_cpp.llama_memory_clear(self.memory, False)
        self.tokens, self.probes, self.partials, self.batch_ends = [], {}, {}, []
        self.windows.clear()
        self.settled_at = self._last_logits = None


def _fit_threads(native: Native, config: SessionConfig) -> ThreadFit:
    """A fit of the decodes' threads for a context ``native`` opened with ``config``:
    adapted to the free cores unless the user gave ``--threads``, flash attention is
    not off, or layers are on a GPU (there the count could change a result)."""
    adapt = config.n_threads is None and native.flash_attn == "off" and native.offload.on_cpu
    ctx = native.ctx
    return ThreadFit(lambda n: llama_cpp.llama_set_n_threads(ctx, n, n), native.n_threads, adapt)
