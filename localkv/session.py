"""A loaded model with one KV sequence: tokenize, prefill, generate, capture, restore.

The session owns its native handles (model, context, batch, LoRA adapters)
through an ``ExitStack``; ``close()`` frees them once and is safe to repeat.

Prefill is *block-aligned* (DESIGN §6): positions are 0..n-1 of sequence 0;
inside each block of ``block_size`` tokens the tokens before the block's last
are decoded in batches and the block's last token is decoded alone. Any extra
boundary (a snapshot tip, the end of the request) is decoded alone too. The
logits of every token decoded alone are returned as that position's probe:
restoring the state of the tokens before it and decoding it alone reproduces
them bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localkv import codec
from localkv.config import FLASH_ATTN_TYPES, LoraSpec, SessionConfig
from localkv.native import ensure_backend, ggml_type_id, llama_cpp
from localkv.sampling import Sampler, SamplingParams

__all__ = [
    "LoraSpec",
    "ModelLoadError",
    "ModelSession",
    "PrefillCancelled",
    "SessionConfig",
]

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]
CancelFn = Callable[[], bool]


class ModelLoadError(RuntimeError):
    """The model, a LoRA adapter or the context could not be created."""


class PrefillCancelled(Exception):
    """Prefill stopped on request; ``done`` tokens are in the KV sequence."""

    def __init__(self, done: int) -> None:
        super().__init__(f"prefill cancelled after {done} tokens")
        self.done = done


@dataclass(slots=True)
class PrefillResult:
    """What a prefill did: probe logits by absolute position of tokens decoded alone."""

    start: int
    end: int
    probes: dict[int, np.ndarray] = field(default_factory=dict)


class ModelSession:
    """One model, one context, one KV sequence (id 0)."""

    def __init__(self, config: SessionConfig) -> None:
        ensure_backend()
        self.config = config
        self._stack = contextlib.ExitStack()
        self.tokens: list[int] = []
        self._last_logits: np.ndarray | None = None
        # logits of tokens decoded alone at block ends and boundaries: the probes
        self.probes: dict[int, np.ndarray] = {}
        self._scratch: np.ndarray | None = None  # reused restore buffer
        # token counts after each llama_decode call: how the sequence was batched.
        # Numerics depend on batching, so a faithful recomputation replays it.
        self.batch_ends: list[int] = []
        try:
            self._open()
        except BaseException:
            self._stack.close()
            raise

    # ----------------------------------------------------------------- setup
    def _open(self) -> None:
        cfg = self.config
        path = Path(cfg.model_path)
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 2**31 - 1 if cfg.n_gpu_layers < 0 else cfg.n_gpu_layers
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load {path} (not a supported GGUF?)")
        self._stack.callback(llama_cpp.llama_model_free, model)
        self.model = model
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
            log.warning("recurrent/hybrid memory: the KV cache codec will refuse this model")

        self._check_kv_types()
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = cfg.n_ctx
        cparams.n_batch = cfg.n_batch
        cparams.n_ubatch = cfg.n_batch
        cparams.n_seq_max = 1
        threads = cfg.n_threads or max(1, os.cpu_count() or 1)
        self.n_threads = threads
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.type_k = ggml_type_id(cfg.type_k)
        cparams.type_v = ggml_type_id(cfg.type_v)
        cparams.flash_attn_type = FLASH_ATTN_TYPES[self.flash_attn_setting()]
        cparams.rope_freq_base = cfg.rope_freq_base
        cparams.rope_freq_scale = cfg.rope_freq_scale
        cparams.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            raise ModelLoadError(
                f"llama.cpp could not create a context (n_ctx={cfg.n_ctx}, type_k={cfg.type_k}, "
                f"type_v={cfg.type_v}, flash_attn={cfg.flash_attn}); a quantized type_v "
                "needs flash attention on"
            )
        self._stack.callback(llama_cpp.llama_free, ctx)
        self.ctx = ctx
        self.memory = llama_cpp.llama_get_memory(ctx)
        self.n_ctx = int(llama_cpp.llama_n_ctx(ctx))
        self._attach_loras(cfg.loras)
        # llama.cpp may lower the batch size (never above n_ctx): use what it took
        self.n_batch = min(cfg.n_batch, int(llama_cpp.llama_n_batch(ctx)), self.n_ctx)
        batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._stack.callback(llama_cpp.llama_batch_free, batch)
        self._batch = batch

    def flash_attn_setting(self) -> str:
        """The flash attention setting passed to llama.cpp (``auto`` lets it decide).

        llama.cpp's ``auto`` enables flash attention where the backend supports it
        (on CPU: yes). Flash attention keeps V untransposed, which makes restores
        cheaper to assemble, but on CPU its logits depend on the thread count
        (measured 0.05-0.4 apart between 1 and 2 threads), so the identity records
        the thread count whenever it is on (see ``localkv.identity``).
        """
        return self.config.flash_attn

    def _check_kv_types(self) -> None:
        # llama.cpp does not always check this itself: with flash attention off a
        # quantized K cache on a head size its block does not divide gives wrong
        # logits or aborts the process.
        cfg = self.config
        head = int(llama_cpp.llama_model_n_embd(self.model)) // max(
            1, int(llama_cpp.llama_model_n_head(self.model))
        )
        for name, kind in (("type_k", cfg.type_k), ("type_v", cfg.type_v)):
            block = 32 if kind.startswith("q") else 1
            if head % block:
                raise ModelLoadError(
                    f"{name}={kind} needs a head size divisible by {block}; this model's is {head}"
                )

    def _attach_loras(self, loras: tuple[LoraSpec, ...]) -> None:
        if not loras:
            return
        handles = []
        for spec in loras:
            if not Path(spec.path).is_file():
                raise ModelLoadError(f"LoRA adapter not found: {spec.path}")
            adapter = llama_cpp.llama_adapter_lora_init(self.model, str(spec.path).encode())
            if not adapter:
                raise ModelLoadError(f"llama.cpp could not load LoRA adapter {spec.path}")
            self._stack.callback(llama_cpp.llama_adapter_lora_free, adapter)
            handles.append(adapter)
        arr = (llama_cpp.llama_adapter_lora_p_ctypes * len(handles))(*handles)
        scales = (ctypes.c_float * len(handles))(*(s.scale for s in loras))
        if llama_cpp.llama_set_adapters_lora(self.ctx, arr, len(handles), scales) != 0:
            raise ModelLoadError("llama.cpp refused the LoRA adapters")

    def close(self) -> None:
        """Free the native handles (idempotent)."""
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
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(
            self.vocab, data, len(data), buf, cap, add_special, parse_special
        )
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(
                self.vocab, data, len(data), buf, cap, add_special, parse_special
            )
        if n < 0:
            raise ValueError("tokenization failed")
        return list(buf[:n])

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(128)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Iterable[int], *, special: bool = False) -> str:
        data = b"".join(self.token_bytes(t, special=special) for t in tokens)
        return data.decode("utf-8", errors="replace")

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def bos_token(self) -> int | None:
        tok = int(llama_cpp.llama_vocab_bos(self.vocab))
        return tok if tok >= 0 else None

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
        if want_last:
            b.logits[n - 1] = 1
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
        """Decode one token alone at the next position and return its logits.

        The logits are kept as a probe when ``probe`` is set or the token ends a block.
        """
        pos = len(self.tokens)
        logits = self._decode([token], want_last=True)
        if logits is None:  # pragma: no cover - want_last guarantees logits
            raise RuntimeError("no logits")
        if probe or (pos + 1) % self.config.block_size == 0:
            self.probes[pos] = logits
        return logits

    def prefill(
        self,
        tokens: list[int],
        *,
        block_size: int | None = None,
        boundaries: Iterable[int] = (),
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
    ) -> PrefillResult:
        """Append ``tokens`` to the sequence, block-aligned.

        ``boundaries`` are absolute token counts (a snapshot tip after k tokens
        means token k-1 is decoded alone). The end of ``tokens`` is always one.
        ``progress(done, total)`` is called after each batch; when ``cancel()``
        turns true, prefill stops between batches and raises ``PrefillCancelled``.
        """
        block_size = block_size or self.config.block_size
        start = len(self.tokens)
        end = start + len(tokens)
        if end > self.n_ctx:
            raise ContextFullError(end, self.n_ctx)
        alone = {p for p in range(start, end) if (p + 1) % block_size == 0}
        alone.update(b - 1 for b in boundaries if start < b <= end)
        if end > start:
            alone.add(end - 1)
        result = PrefillResult(start, end)
        pos = start
        while pos < end:
            if cancel is not None and cancel():
                raise PrefillCancelled(pos - start)
            if pos in alone:
                result.probes[pos] = self.decode_one(tokens[pos - start], probe=True)
                pos += 1
            else:
                stop = min(end, pos + self.n_batch, min((a for a in alone if a > pos), default=end))
                self._decode(tokens[pos - start : stop - start], want_last=False)
                pos = stop
            if progress is not None:
                progress(pos - start, end - start)
        return result

    def replay(self, tokens: list[int], batch_ends: Iterable[int]) -> dict[int, np.ndarray]:
        """Decode ``tokens`` from an empty sequence in exactly the given batches.

        Returns the logits of every single-token batch (the probes), by position.
        """
        self.reset()
        ends = sorted({e for e in batch_ends if 0 < e <= len(tokens)} | {len(tokens)})
        probes: dict[int, np.ndarray] = {}
        start = 0
        for end in ends:
            while start < end:
                stop = min(end, start + self.n_batch)
                logits = self._decode(tokens[start:stop], want_last=stop - start == 1)
                if logits is not None:
                    probes[stop - 1] = logits
                start = stop
        return probes

    def generate(
        self,
        params: SamplingParams,
        *,
        cancel: CancelFn | None = None,
    ) -> Iterator[int]:
        """Sample tokens after the current sequence until end of generation.

        Yields each token id as sampled; the token is in the sequence when the
        next one is requested. Stops at an end-of-generation token (not yielded),
        ``params.max_tokens``, a full context or ``cancel()``.
        """
        logits = self._last_logits
        if logits is None:
            raise RuntimeError("generate needs the logits of the last token: prefill first")
        sampler = Sampler(params)
        for _ in range(params.max_tokens):
            if cancel is not None and cancel():
                return
            token = sampler.sample(logits)
            if self.is_end_of_generation(token):
                return
            yield token
            if len(self.tokens) >= self.n_ctx:
                return
            logits = self.decode_one(token)

    # ------------------------------------------------------------------ state
    def capture_state(self) -> bytes:
        """The raw llama.cpp state of sequence 0."""
        return self.capture_array().tobytes()

    def capture_array(self) -> np.ndarray:
        """The raw llama.cpp state of sequence 0, written straight into a new uint8 array."""
        size = int(llama_cpp.llama_state_seq_get_size(self.ctx, 0))
        arr = np.empty(size, dtype=np.uint8)
        ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        written = llama_cpp.llama_state_seq_get_data(self.ctx, ptr, size, 0)
        if written != size:
            raise RuntimeError(f"state capture wrote {written} of {size} bytes")
        return arr

    def capture(self) -> codec.KVState:
        """The parsed state of sequence 0 (raises ``StateFormatError`` if unknown).

        Its K/V rows are views of one capture buffer: no copy of the state is made.
        """
        return codec.parse(self.capture_array().data, copy=False)

    def load_state(self, data: bytes | bytearray | np.ndarray, tokens: list[int]) -> None:
        """Replace sequence 0 with a raw state holding ``tokens`` at positions 0..n-1."""
        self.reset()
        if len(tokens) > self.n_ctx:
            raise ContextFullError(len(tokens), self.n_ctx)
        if isinstance(data, np.ndarray):
            arr = np.ascontiguousarray(data, dtype=np.uint8)
        else:
            arr = np.frombuffer(bytes(data), dtype=np.uint8)
        size = int(arr.shape[0])
        ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        read = llama_cpp.llama_state_seq_set_data(self.ctx, ptr, size, 0)
        if read != size:
            self.reset()
            raise codec.StateFormatError(f"llama.cpp accepted {read} of {size} state bytes")
        self.tokens = list(tokens)
        self.batch_ends = [len(tokens)]  # as far as this process knows

    def restore(self, state: codec.KVState | Sequence[codec.KVState], tokens: list[int]) -> None:
        """Load a parsed state, or consecutive pieces of one, holding exactly ``tokens``.

        Positions must be 0..n-1: a prefix cache never moves state elsewhere.
        """
        parts = [state] if isinstance(state, codec.KVState) else list(state)
        n = len(tokens)
        positions = np.concatenate([p.positions for p in parts])[:n]
        if positions.shape[0] != n or not np.array_equal(positions, np.arange(n)):
            raise codec.StateFormatError("state positions are not 0..n-1")
        scratch = self._scratch_for(codec.assembled_size(parts, n), n)
        self.load_state(codec.assemble(parts, n_tokens=n, scratch=scratch), tokens)

    def restore_buffer(
        self, layout: Sequence[codec.LayerLayout], n: int
    ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """A state buffer for ``n`` tokens (untransposed V) whose K/V rows the caller fills.

        ``codec.assembly`` in the session's reused scratch memory; hand the
        filled buffer to ``load_state``.
        """
        scratch = self._scratch_for(codec.state_size(layout, False, n), n)
        return codec.assembly(layout, n, scratch=scratch)

    def _scratch_for(self, size: int, n: int) -> np.ndarray:
        if self._scratch is None or self._scratch.shape[0] < size:
            # room for the whole context, so later restores reuse the same pages
            per_token = max(1, size // max(1, n))
            self._scratch = large_buffer(max(size, per_token * self.n_ctx + 4096))
        return self._scratch

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens of the sequence."""
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"cannot keep {n} of {len(self.tokens)} tokens")
        if n == len(self.tokens):
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
        self.tokens = []
        self.probes = {}
        self.batch_ends = []
        self._last_logits = None


def large_buffer(nbytes: int) -> np.ndarray:
    """A uint8 array for a restore buffer, backed by transparent huge pages where possible.

    Its pages are touched for the first time by a restore; with 2 MiB pages
    that costs one fault per 2 MiB instead of one per 4 KiB (measured on this
    project's 2-core VM: 25 ms instead of 112 ms for the first 47 MB).
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if advice is None or not flags:
        return np.empty(nbytes, dtype=np.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=flags)
    with contextlib.suppress(OSError):
        mapping.madvise(advice)
    return np.frombuffer(mapping, dtype=np.uint8)


class ContextFullError(ValueError):
    """The request does not fit in the context window."""

    def __init__(self, needed: int, n_ctx: int) -> None:
        super().__init__(
            f"{needed} tokens do not fit in the context of {n_ctx} tokens "
            "(raise it with --ctx, or shorten the input)"
        )
        self.needed = needed
        self.n_ctx = n_ctx
