"""The runtime API: one model, its verified cache, documents, questions and chats.

The CLI and the chat app use this module and nothing lower. Example::

    import localkv

    with localkv.Runtime.open() as rt:                  # default model, default cache
        doc = localkv.read_document("notes.txt")
        rt.prefill([doc], system="Answer from the document.")   # once
        answer = rt.ask([doc], "What is due on Friday?",
                        system="Answer from the document.",
                        params=localkv.SamplingParams(temperature=0))
        print(answer.text, answer.cache.reused)         # restored, verified

A later process that asks about the same document restores its KV state from
disk instead of prefilling it again.
"""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from localkv.cache.background import BackgroundWork
from localkv.cache.budgeting import fit_budget
from localkv.cache.catalogue import (
    ClientPin,
    SnapshotName,
    covering_snapshot,
    has_room,
    save_prefill,
    source_sha,
)
from localkv.cache.lookup import is_not_cached, near_miss
from localkv.cache.prefix import PrefixCache, RestoreResult, SaveResult, open_prefix_cache
from localkv.model.find import model_label, resolve_model
from localkv.model.sampling import SamplingParams, check_grammar, json_schema_grammar
from localkv.model.session import (
    CancelFn,
    ContextFullError,
    ModelSession,
    PrefillCancelled,
    ProgressFn,
    SessionConfig,
)
from localkv.prompt.conversation import stream_answer
from localkv.prompt.request import Document, Request, build_request
from localkv.prompt.template import ChatTemplate
from localkv.runtime.callbacks import TextFn
from localkv.runtime.info import LoadedModel, SnapshotInfo, list_snapshots
from localkv.runtime.reports import Answer, CacheReport, PrefillReport, Timing, TokenCounts

__all__ = ["AskCancelled", "BeforePrefillFn", "Runtime"]

log = logging.getLogger(__name__)

# the restore's outcome and the tokens left to prefill, told before they are
BeforePrefillFn = Callable[[CacheReport, int], None]


class AskCancelled(Exception):
    """An ask cancelled while it prefilled; ``report`` says what the cache kept of it."""

    def __init__(self, report: PrefillReport) -> None:
        super().__init__(f"cancelled: kept {report.kept:,} of {report.tokens:,} tokens")
        self.report = report


class Runtime:
    """A model session plus its verified prefix cache."""

    def __init__(
        self,
        config: SessionConfig,
        *,
        cache_dir: str | Path | None = None,
        namespace: str = "default",
        use_cache: bool = True,
        compact_cache: bool = False,
    ) -> None:
        self.session = ModelSession(config)
        self.template = ChatTemplate(self.session, config.chat_template)
        self.namespace = namespace
        self.cache: PrefixCache | None = None
        self.cache_error: str | None = None if use_cache else "cache disabled"
        self.work = BackgroundWork()  # saves and bookkeeping, after the answer
        self._rate = 1 / 240  # a first guess, updated from the prefills this runtime times
        if use_cache:
            self._open_cache(cache_dir, compact_cache)

    @classmethod
    def open(
        cls,
        model: str | Path | None = None,
        *,
        cache_dir: str | Path | None = None,
        namespace: str = "default",
        use_cache: bool = True,
        compact_cache: bool = False,
        **options: object,
    ) -> Runtime:
        """Open ``model`` (default: ``LOCALKV_MODEL``, then the default model package).

        ``compact_cache``: write new blocks compressed (see ``SnapshotStore.open``).
        """
        config = SessionConfig(model_path=resolve_model(model), **options)  # type: ignore[arg-type]
        return cls(
            config,
            cache_dir=cache_dir,
            namespace=namespace,
            use_cache=use_cache,
            compact_cache=compact_cache,
        )

    def _open_cache(self, cache_dir: str | Path | None, compact: bool) -> None:
        self.cache, self.cache_error = open_prefix_cache(
            self.session, cache_dir, compact, self.namespace, self.work.defer
        )
        if self.cache is not None:
            self._rate = self.cache.seconds_per_token(self.session.n_ctx) or self._rate
        if self.cache_error:  # info: the faces say it once (the CLI's cache line or warning)
            log.info("%s; continuing without the cache", self.cache_error)

    def prepare_restores(self) -> int:
        """Make this thread's restore buffers ready (``PrefixCache.prepare_restores``): for
        a server, on its model thread before it is ready. The bytes made ready."""
        return self.cache.prepare_restores(self.session) if self.cache is not None else 0

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Finish pending saves, then free the store and the model (idempotent)."""
        self.work.close()
        if self.cache is not None:
            self.cache.store.close()
            self.cache = None
        self.session.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_for_saves(self) -> list[SaveResult]:
        """Wait for the blocks being written in the background; their results."""
        return self.work.wait()

    # ------------------------------------------------------------ information
    def model_info(self) -> LoadedModel:
        """Name, quantization, file size, GPU layers and KV types, for display."""
        cfg = self.session.config
        path = Path(cfg.model_path)
        return LoadedModel(
            name=path.stem,
            description=model_label(path) or self.session.describe(),
            path=str(path),
            file_bytes=path.stat().st_size,
            n_gpu_layers=self.session.offload.layers,
            device=", ".join(d.name for d in self.session.offload.devices)
            if self.session.offload.layers
            else "",
            type_k=cfg.type_k,
            type_v=cfg.type_v,
            flash_attn=self.flash_attn_effective(),
            n_ctx=self.session.n_ctx,
        )

    def flash_attn_effective(self) -> str:
        """``on``/``off`` as llama.cpp chose it (from the cache identity), else the setting."""
        if self.cache is not None:
            return "on" if self.cache.identity.flash_attn else "off"
        return self.session.flash_attn_setting()

    def snapshots(self) -> list[SnapshotInfo]:
        """This namespace's snapshots, of every model."""
        if self.cache is None:
            return []
        return list_snapshots(self.cache.store, self.namespace, self.cache.identity.digest)

    def set_pinned(self, snapshot_id: str, pinned: bool) -> None:
        if self.cache is None:
            raise RuntimeError(self.cache_error or "cache disabled")
        if pinned:
            self.cache.store.pin(snapshot_id)
        else:
            self.cache.store.unpin(snapshot_id)

    def remove_snapshot(self, snapshot_id: str) -> int:
        """Remove a snapshot and the blocks only it needs; returns bytes freed."""
        if self.cache is None:
            raise RuntimeError(self.cache_error or "cache disabled")
        self.wait_for_saves()
        return self.cache.store.remove_snapshot(snapshot_id)

    # ---------------------------------------------------------------- helpers
    def build(
        self, documents: Sequence[Document], *, system: str | None, question: str | None = None
    ) -> Request:
        return build_request(self.template, system=system, documents=documents, question=question)

    def schedule(self, request: Request) -> list[int]:
        """The request's canonical batch ends (``localkv.model.schedule``)."""
        return self.session.schedule(len(request.tokens), request.boundaries)

    def restore(
        self, tokens: list[int], ends: Sequence[int]
    ) -> tuple[RestoreResult | None, CacheReport]:
        """Empty the sequence and restore the longest verified, exact prefix of ``tokens``.

        ``ends`` is the request's canonical schedule (``schedule``). Pending
        background saves finish first: they may hold exactly this prefix.
        """
        self.wait_for_saves()
        self.session.reset()
        if self.cache is None:
            reason = self.cache_error or "cache disabled"
            return None, CacheReport(
                hit=False,
                verified=None,
                snapshot=None,
                miss_reason=reason,
                reused=0,
                restore_s=0.0,
                saved_s=0.0,
            )
        try:
            result = self.cache.restore(self.session, tokens, ends)
        except (OSError, sqlite3.Error) as exc:  # an unreadable index or disk: prefill instead
            log.warning("cache lookup failed (%s); continuing without it", exc)
            self.session.reset()
            return None, CacheReport(
                hit=False,
                verified=None,
                snapshot=None,
                miss_reason=f"cache error: {exc}",
                reused=0,
                restore_s=0.0,
                saved_s=0.0,
            )
        report = CacheReport(
            hit=result.reused > 0,
            verified=result.verified,
            snapshot=None,  # named later, off the first-token path: see with_snapshot
            miss_reason=result.miss_reason,
            reused=result.reused,
            restore_s=result.seconds,
            saved_s=result.saved_seconds,
            common=result.common,
            steps=dict(result.breakdown) if result.reused > 0 else {},
            held=result.held,
        )
        return result, report

    def with_snapshot(
        self, result: RestoreResult | None, report: CacheReport, tokens: list[int]
    ) -> CacheReport:
        """``report`` naming the longest snapshot that the reused prefix contains."""
        if result is None or self.cache is None:
            return report
        snapshot = covering_snapshot(self.cache.store, self.namespace, result, tokens)
        return dataclasses.replace(report, snapshot=snapshot)

    def _check_fits(self, request: Request, room: int) -> None:
        if len(request.tokens) + room > self.session.n_ctx:
            raise ContextFullError(len(request.tokens) + room, self.session.n_ctx)

    # ---------------------------------------------------------------- prefill
    def prefill(
        self,
        documents: Sequence[Document],
        *,
        system: str | None = None,
        label: str | None = None,
        pin: bool | ClientPin = False,
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
    ) -> PrefillReport:
        """Prefill ``[system][documents...]`` and save it as a snapshot (``pin``: the user's
        pin, or a server's client's, made only within the clients' share of the budget).

        Cancelling (``cancel()`` true) keeps every block already completed.
        """
        t0 = time.perf_counter()
        request = self.build(documents, system=system)
        self._check_fits(request, 0)
        ends = self.schedule(request)
        restored, report = self.restore(request.tokens, ends)
        reused = self.session.n_tokens
        t1 = time.perf_counter()
        early: list[SaveResult] = []  # blocks saved while the prefill went on
        cancelled = self._prefill_saving(request, ends, progress, cancel, early)
        self.wait_for_saves()
        prefilled = self.session.n_tokens - reused
        self.note_prefill(time.perf_counter() - t1, prefilled)
        done = self.session.n_tokens
        tips = [b for b in request.boundaries if b <= done] + [done]
        name = None if cancelled else SnapshotName(label, pin, system or "")
        stored = save_prefill(
            self.cache, self.session, tips, documents, name, seconds_per_token=self._rate
        )
        saved = stored.saved
        return PrefillReport(
            snapshot=stored.snapshot,
            tokens=len(request.tokens),
            reused=reused,
            prefilled=prefilled,
            blocks=saved.blocks,
            new_blocks=saved.new_blocks + sum(r.new_blocks for r in early),
            bytes_on_disk=stored.bytes_on_disk,
            seconds=time.perf_counter() - t0,
            cancelled=cancelled,
            kept=stored.kept,
            cache=self.with_snapshot(restored, report, request.tokens),
            not_kept=saved.not_kept,
            over_budget=saved.over_budget,
            not_saved=saved.error,
        )

    def _prefill_saving(
        self,
        request: Request,
        ends: Sequence[int],
        progress: ProgressFn | None,
        cancel: CancelFn | None,
        early: list[SaveResult],
    ) -> bool:
        """Prefill the rest of ``request`` a block at a time; True if cancelled.

        After each completed block the blocks so far are saved in the background
        (never delaying the next batch), so a process killed mid-prefill keeps
        every block that was written before the kill; their results go to
        ``early``. Once one has failed for want of room (a full disk) no more
        are tried: the save at the end tries once more, and says why.
        """
        start, total = self.session.n_tokens, len(request.tokens)
        block = self.session.config.block_size
        stops = sorted({e for e in ends if e > start and e % block == 0} | {total})
        for stop in stops:
            begin = self.session.n_tokens

            def overall(done: int, _: int, begin: int = begin) -> None:
                if progress is not None:
                    progress(begin - start + done, total - start)

            try:
                self.session.prefill(
                    request.tokens[begin:stop], ends=ends, progress=overall, cancel=cancel
                )
            except PrefillCancelled:
                return True
            log.info("prefill: %d of %d tokens computed", stop, total)
            if stop < total and not self._no_room(early):
                tips = [b for b in request.boundaries if b < stop] + [stop]
                self.save_prefix(tips, early.append)
        return False

    def _no_room(self, early: list[SaveResult]) -> bool:
        failed = any(r.error for r in early)
        return failed and (self.cache is None or not has_room(self.cache))

    # -------------------------------------------------------------------- ask
    def ask(  # noqa: PLR0913 - to take a value type
        self,
        documents: Sequence[Document],
        question: str,
        *,
        system: str | None = None,
        params: SamplingParams | None = None,
        json_schema: Mapping[str, Any] | str | None = None,
        on_text: TextFn | None = None,
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
        before_prefill: BeforePrefillFn | None = None,
    ) -> Answer:
        """Answer ``question`` about ``documents``, restoring what the cache holds.

        Text pieces stream to ``on_text``; the prompt's new blocks are saved in the
        background after the answer, never before its first token. ``json_schema``
        (an object or its JSON text) makes the answer JSON that it describes, as a
        grammar in ``params`` does; a schema or grammar that cannot constrain the
        answer raises ``GrammarError`` before anything is computed.

        ``before_prefill(report, n)``: the restore and the tokens left to prefill.
        ``cancel()`` stops the prefill between batches (``AskCancelled``: the blocks
        completed, saved at once), or the answer."""
        params = params or SamplingParams()
        if json_schema is not None:
            params = dataclasses.replace(params, grammar=json_schema_grammar(json_schema))
        if params.grammar is not None:
            check_grammar(self.session.vocab, params.grammar)
        t0 = time.perf_counter()
        request = self.build(documents, system=system, question=question)
        self._check_fits(request, 1)
        ends = self.schedule(request)
        with self.work.held():  # the restore's bookkeeping waits for the answer
            (restored, report), prefill_s = self._restore_and_prefill(
                request, ends, progress, cancel, self._telling(documents, system, before_prefill)
            )
            answer = None
            if prefill_s is not None:
                answer = stream_answer(self.session, params, t0, on_text, cancel)
        if answer is None or prefill_s is None:
            raise AskCancelled(self._keep_cancelled(documents, request, (restored, report), t0))
        reused = report.reused
        total = time.perf_counter() - t0
        self.note_prefill(prefill_s, len(request.tokens) - reused)
        self.save_prefix(request.boundaries)
        return Answer(
            text=answer.text,
            tokens=TokenCounts(
                prompt=len(request.tokens),
                reused=reused,
                prefilled=len(request.tokens) - reused,
                generated=len(answer.ids),
            ),
            cache=self.with_snapshot(restored, report, request.tokens),
            timing=Timing(
                restore_s=report.restore_s, prefill_s=prefill_s, ttft_s=answer.ttft_s, total_s=total
            ),
            finish_reason=answer.finish_reason,
        )

    def _restore_and_prefill(
        self,
        request: Request,
        ends: Sequence[int],
        progress: ProgressFn | None,
        cancel: CancelFn | None,
        told: Callable[[CacheReport, int], CacheReport],
    ) -> tuple[tuple[RestoreResult | None, CacheReport], float | None]:
        """Restore what the cache holds of ``request``, prefill the rest; the restore (as
        ``told`` makes it) and the prefill's seconds (None: cancelled)."""
        restored, report = self.restore(request.tokens, ends)
        reused = self.session.n_tokens
        report = told(report, len(request.tokens) - reused)
        t1 = time.perf_counter()
        try:
            self.session.prefill(
                request.tokens[reused:], ends=ends, progress=progress, cancel=cancel
            )
        except PrefillCancelled:
            return (restored, report), None
        return (restored, report), time.perf_counter() - t1

    def _telling(
        self,
        documents: Sequence[Document],
        system: str | None,
        before_prefill: BeforePrefillFn | None,
    ) -> Callable[[CacheReport, int], CacheReport]:
        """The restore's report, its miss named by its nearest cause, told to
        ``before_prefill`` with the tokens left to prefill."""

        def told(report: CacheReport, n: int) -> CacheReport:
            report = self.nearest_cause(report, documents, system)
            if before_prefill is not None:
                before_prefill(report, n)
            return report

        return told

    def nearest_cause(
        self, report: CacheReport, documents: Sequence[Document], system: str | None
    ) -> CacheReport:
        """``report``; a first run or another identity's miss named by a snapshot of the
        same documents made otherwise, where there is one (``near_miss``)."""
        reason = report.miss_reason or ""
        plain = is_not_cached(reason) or reason.startswith("identity differs")
        if self.cache is None or report.hit or not plain:
            return report
        cache = self.cache
        try:
            why = near_miss(
                cache.store, cache.identity, self.namespace, source_sha(documents), system
            )
        except (OSError, sqlite3.Error, ValueError) as exc:  # naming is never worth a failure
            log.warning("could not look for a snapshot of the same documents: %s", exc)
            return report
        return dataclasses.replace(report, miss_reason=why) if why else report

    def _keep_cancelled(
        self,
        documents: Sequence[Document],
        request: Request,
        restore: tuple[RestoreResult | None, CacheReport],
        t0: float,
    ) -> PrefillReport:
        """Save the blocks a cancelled ask completed (no snapshot: its prompt is not whole)."""
        reused = restore[1].reused
        done = self.session.n_tokens
        tips = [b for b in request.boundaries if b <= done] + [done]
        stored = save_prefill(
            self.cache, self.session, tips, documents, None, seconds_per_token=self._rate
        )
        return PrefillReport(
            snapshot=None,
            tokens=len(request.tokens),
            reused=reused,
            prefilled=done - reused,
            blocks=stored.saved.blocks,
            new_blocks=stored.saved.new_blocks,
            bytes_on_disk=stored.bytes_on_disk,
            seconds=time.perf_counter() - t0,
            cancelled=True,
            kept=stored.kept,
            cache=self.with_snapshot(restore[0], restore[1], request.tokens),
            not_kept=stored.saved.not_kept,
            over_budget=stored.saved.over_budget,
            not_saved=stored.saved.error,
        )

    def note_prefill(self, seconds: float, tokens: int) -> None:
        """A timed prefill: it joins the one rate (per identity and n_ctx) every writer uses."""
        if tokens >= 32 and seconds > 0:
            cache, n = self.cache, self.session.n_ctx
            self._rate = cache.note_prefill(n, seconds, tokens) if cache else seconds / tokens

    def save_prefix(
        self, tips: Sequence[int], on_saved: Callable[[SaveResult], None] | None = None
    ) -> None:
        """Save the session's sequence up to its last tip, in the background.

        The state is captured now (a few ms); encoding and writing happen on a
        worker thread, which hands the result to ``on_saved``. ``close()`` and
        ``wait_for_saves()`` wait for them.
        """
        if self.cache is None:
            return
        cache = self.cache
        blocks = cache.prepare(self.session, tips, self._rate)
        if blocks:

            def write_then_evict() -> SaveResult:
                result = fit_budget(cache, cache.write(blocks))
                if on_saved is not None:
                    on_saved(result)
                return result

            self.work.submit(write_then_evict)
