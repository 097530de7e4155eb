"""What one request does on the runtime: find the prefix, restore or prefill, generate.

Runs on the worker thread that owns the model (``worker``), one request at a
time. Reuse comes from the live context when it holds the prompt's prefix (no
disk read), else from the disk cache (verified), else prefill; the prompt's
new blocks are saved in the background after the answer, as ``chat`` does.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from localkv.cache.catalogue import ClientPin, pinned
from localkv.model.native import llama_cpp
from localkv.model.sampling import GrammarError, SamplingParams, check_grammar
from localkv.model.schedule import shared_end
from localkv.model.state import STATE_WORK, ContextFullError
from localkv.prompt.conversation import stream_answer
from localkv.prompt.template import Message
from localkv.runtime import Runtime
from localkv.runtime.callbacks import TextFn
from localkv.runtime.chatsession import ChatSession, ChatState, SyncReport
from localkv.runtime.reports import CacheReport
from localkv.server.conversation import (
    AnswerMemory,
    MessageMemory,
    Prompt,
    build_prompt,
    common_prefix,
)
from localkv.server.errors import ApiError, bad_request
from localkv.server.limits import Budget
from localkv.server.prefixes import (
    KeptPins,
    Pin,
    new_tokens,
    pin_ends,
    pin_namer,
    prefill_body,
    prefix_label,
    snapshot_namer,
)
from localkv.server.requests import (
    RESTORE_STEPS,
    Channel,
    ChatRequest,
    CompletionRequest,
    ModelFacts,
    Outcome,
    Sampling,
)
from localkv.server.rows import ServerConversation, conversation_label, stem_end
from localkv.server.stops import StopText
from localkv.server.tools import answer_text, tool_params, with_answer
from localkv.storage.removal.budget import ENV_CLIENT_PINS

__all__ = ["Engine", "Outcome"]

log = logging.getLogger(__name__)


class Engine:
    """The runtime, plus the sampled ids of recent answers (for resent histories).

    ``max_tokens`` bounds every answer: a request that gives no limit gets it, one
    that asks for more is capped to it (None: the context's room is the only bound).
    """

    def __init__(self, runtime: Runtime, *, max_tokens: int | None = None) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (None: no limit), got {max_tokens}")
        self.runtime = runtime
        self.max_tokens = max_tokens
        self.memory = AnswerMemory()
        self.known = MessageMemory()  # tokens of user and system messages seen before
        self._work_at, self._queued = self._work(), 0.0
        self._prompt_s = 0.0  # the request's prompt building: render and tokenize
        self.model_id = Path(runtime.session.config.model_path).stem
        self.facts = model_facts(runtime, self.model_id)

    # ------------------------------------------------------------------ chat
    def chat(self, request: ChatRequest, channel: Channel) -> Outcome:
        t0 = time.perf_counter()
        self._work_at, self._queued = self._work(), t0 - channel.arrived
        template = self.runtime.template
        self._check_grammar(request.sampling)
        built = self._build(request, channel)
        state, prompt = built.state, list(built.state.tokens)
        pins = pin_ends(built, request.messages, request.breakpoints)
        chat = ChatSession(self.runtime, state)  # state.tokens is never empty here
        # one conversation, one row: it replaces the row of the same stem
        chat.snapshot = ServerConversation(
            self.runtime, prompt[: stem_end(built.reach, request.messages)]
        )
        label = conversation_label(request.messages)
        sync, diverged = self._sync(chat, state, channel)
        stops = StopText(request.sampling.stop)
        params = tool_params(self._params(request.sampling, len(prompt)), request, template)
        if sync.cancelled:  # the client went away during the prefill
            return self._outcome(
                t0, prompt, sync, diverged, stops, ids=[], ttft_s=0.0, params=params, cancelled=True
            )
        split = answer_text(request, self.runtime.session, prompt, channel)
        answer = stream_answer(
            self.runtime.session,
            params,
            t0,
            _sender(stops, split.push),
            lambda: stops.hit or channel.cancelled(),
        )
        split.push(stops.flush())
        split.finish()
        kept = KeptPins()
        self._close_turn(chat, (answer.ids, answer.text, stops.text), label, (pins, kept))
        if pins and not channel.cancelled():
            self.runtime.wait_for_saves()  # the usage counts only the pins that were made
        outcome = self._outcome(
            t0,
            prompt,
            sync,
            diverged,
            stops,
            ids=answer.ids,
            ttft_s=answer.ttft_s,
            params=params,
            cancelled=channel.cancelled(),
        )
        asked = (len(request.breakpoints), len(kept.ends))
        outcome = replace(outcome, pinned_new=new_tokens(kept.last, outcome), breakpoints=asked)
        outcome = with_answer(outcome, split)
        if outcome.reasoning:  # the reasoning's text, tokenized: at most what was sampled
            thought = len(self.runtime.template.text_tokens(outcome.reasoning))
            outcome = replace(outcome, reasoning_tokens=min(thought, outcome.generated))
        return outcome

    def _build(self, request: ChatRequest, channel: Channel) -> Prompt:
        """The request's prompt: the template's render and the tokenizing, timed."""
        t0, template = time.perf_counter(), self.runtime.template
        work = template.work()
        budget = Budget(self.runtime.session.n_ctx, channel.cancelled)
        try:
            built = build_prompt(
                template, request.messages, self.memory, budget, request.tools, known=self.known
            )
        finally:
            _log_work(template.work(), work, len(request.messages))
        self._prompt_s = time.perf_counter() - t0
        return built

    def _close_turn(
        self,
        chat: ChatSession,
        answer: tuple[list[int], str, str],
        label: str,
        pins: tuple[Sequence[Pin], KeptPins] | None = None,
    ) -> None:
        """Keep the answer in the live context with the turn's closing tokens, then save
        it as the snapshot ``label`` names.

        ``answer``: the sampled ids, their text, the text the client got. The same
        tokens as ``ChatSession`` records after a turn; the sampled ids are remembered
        under the text the client got, when that is the whole answer.
        """
        ids, full, shown = answer
        state, session = chat.state, self.runtime.session
        history = list(state.messages)
        start = len(state.tokens)
        if shown == full:
            self.memory.remember(state.tokens, full, ids)
        if session.n_tokens > start:
            state.generated.append((start, session.n_tokens))
        state.tokens.extend(ids)
        state.messages.append(Message("assistant", full))
        state.tokens.extend(self.runtime.template.assistant_end_tokens(history, full))
        del state.tokens[session.n_ctx :]
        state.boundaries.append(len(state.tokens))
        pending = state.tokens[session.n_tokens :]
        if pending and session.n_tokens == start + len(ids):
            session.prefill(pending, ends=chat.schedule())
        namer = snapshot_namer(chat.snapshot, label, state.boundaries[-1])
        if pins is not None:
            prompt = (list(state.tokens), chat.schedule())
            namer = pin_namer(self.runtime, namer, label, pins[0], prompt, kept=pins[1])
        self.runtime.save_prefix(state.boundaries, namer)

    def count(self, request: ChatRequest, channel: Channel) -> int:
        """The prompt tokens ``chat`` would run for ``request`` (nothing is computed)."""
        budget = Budget(self.runtime.session.n_ctx, channel.cancelled)
        template, tools = self.runtime.template, request.tools
        built = build_prompt(template, request.messages, self.memory, budget, tools)
        return len(built.state.tokens)

    # ----------------------------------------------------------- completions
    def complete(self, request: CompletionRequest, channel: Channel) -> Outcome:
        t0 = time.perf_counter()
        self._work_at, self._queued = self._work(), t0 - channel.arrived
        session, template = self.runtime.session, self.runtime.template
        self._check_grammar(request.sampling)
        tokenizing = time.perf_counter()
        budget = Budget(session.n_ctx, channel.cancelled, param="prompt")
        if isinstance(request.prompt, str):
            prompt = template.prompt_start_tokens()
            budget.before_text(len(prompt), request.prompt)
            prompt += template.text_tokens(request.prompt)
        else:
            prompt = list(request.prompt)
            if any(t >= session.n_vocab for t in prompt):
                raise bad_request(f"token ids must be below {session.n_vocab}", "prompt")
        if not prompt:
            raise bad_request("the prompt has no tokens", "prompt")
        budget.after(len(prompt))
        self._prompt_s = time.perf_counter() - tokenizing
        state = ChatState(tokens=list(prompt), boundaries=[len(prompt)])
        chat = ChatSession(self.runtime, state)
        sync, diverged = self._sync(chat, state, channel)
        stops = StopText(request.sampling.stop)
        params = self._params(request.sampling, len(prompt))
        if sync.cancelled:
            return self._outcome(
                t0, prompt, sync, diverged, stops, ids=[], ttft_s=0.0, params=params, cancelled=True
            )
        answer = stream_answer(
            session,
            params,
            t0,
            _sender(stops, channel.text),
            lambda: stops.hit or channel.cancelled(),
        )
        channel.text(stops.flush())
        label = prefix_label(request.prompt)
        self.runtime.save_prefix(
            state.boundaries, snapshot_namer(chat.snapshot, label, state.boundaries[-1])
        )
        return self._outcome(
            t0,
            prompt,
            sync,
            diverged,
            stops,
            ids=answer.ids,
            ttft_s=answer.ttft_s,
            params=params,
            cancelled=channel.cancelled(),
        )

    # ------------------------------------------------------------- the cache
    def _sync(
        self, chat: ChatSession, state: ChatState, channel: Channel
    ) -> tuple[SyncReport, int | None]:
        """Bring the KV sequence to the prompt: live context, else disk, else prefill.

        Returns the sync report and the first position where the live context
        diverged from the prompt (None when it did not). A prefill of 2,048 tokens
        or more logs its progress: a line each time another eighth of it (at least
        1,024 tokens) is computed, so at most seven; the request's own line says the end.
        """
        session, prompt = self.runtime.session, state.tokens
        n = len(prompt)
        channel.started()
        live = session.tokens
        common = common_prefix(live, prompt)
        diverged = common if common < min(len(live), n) else None
        ends = chat.schedule()
        keep = shared_end(session.batch_ends, ends, min(common, n - 1)) if common else 0
        # with nothing live to keep, the sync's restore looks the prompt up itself (once)
        if 0 < keep < n - 1 and self._on_disk(prompt, ends) > keep:
            session.reset()  # the disk holds more of this prompt than the live context
        elif 0 < keep < len(live):
            session.truncate(keep)
        logged = [0]

        def progress(done: int, total: int) -> None:
            step = max(1024, -(-total // 8))
            if total < 2048 or done >= total or done < logged[0] + step:
                return
            logged[0] = done
            reused = n - total
            log.info("prefill: %d of %d tokens computed; %d of %d reused", done, total, reused, n)

        return chat.sync(progress, cancel=channel.cancelled), diverged

    def _on_disk(self, tokens: Sequence[int], ends: Sequence[int]) -> int:
        """How many of ``tokens`` the disk cache could restore (an index lookup only)."""
        cache = self.runtime.cache
        if cache is None:
            return 0
        self.runtime.wait_for_saves()
        try:
            return cache.plan(tokens, ends).reuse
        except (OSError, sqlite3.Error) as exc:
            log.warning("cache lookup failed: %s", exc)
            return 0

    def _params(self, sampling: Sampling, n_prompt: int) -> SamplingParams:
        """The request's sampling; its answer bounded by the server's ``max_tokens``, which
        a limit asked for above it is capped to, and by the context's room."""
        room = self.runtime.session.n_ctx - n_prompt
        bound = room if self.max_tokens is None else min(self.max_tokens, room)
        wanted = sampling.max_tokens if sampling.max_tokens is not None else bound
        if self.max_tokens is not None and wanted > self.max_tokens:
            log.debug(
                "%d tokens asked: capped to the server's limit of %d", wanted, self.max_tokens
            )
        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            max_tokens=max(1, min(wanted, bound)),
            min_p=0.0,  # the OpenAI API samples with neither: a request gets what it asks
            repeat_penalty=1.0,
            grammar=sampling.grammar,
        )

    def _check_grammar(self, sampling: Sampling) -> None:
        """A 400 before any work when llama.cpp refuses the request's grammar."""
        if sampling.grammar is not None:
            try:
                check_grammar(self.runtime.session.vocab, sampling.grammar)
            except GrammarError as exc:
                raise bad_request(f"response_format: {exc}", "response_format") from None

    def _outcome(  # noqa: PLR0913 - to take a value type
        self,
        t0: float,
        prompt: list[int],
        sync: SyncReport,
        diverged: int | None,
        stops: StopText,
        *,
        ids: list[int],
        ttft_s: float,
        params: SamplingParams,
        cancelled: bool,
    ) -> Outcome:
        report = sync.cache
        cached = sync.reused  # not what a cancelled prefill left undone
        if cancelled:
            finish = "cancelled"
        elif stops.hit:
            finish = "stop"
        else:
            full = (
                len(ids) >= params.max_tokens
                or len(prompt) + len(ids) >= self.runtime.session.n_ctx
            )
            finish = "length" if full else "stop"
        source = "none" if cached == 0 else "live" if report is None else _source(report)
        return Outcome(
            text=stops.text,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            generated=len(ids),
            source=source,
            verified=None if report is None else report.verified,
            restore_ms=0.0 if report is None else report.restore_s * 1000,
            miss_reason=None if report is None else report.miss_reason,
            diverged_at=diverged,
            ttft_s=ttft_s,
            total_s=time.perf_counter() - t0,
            work=self._work_since(),
            queued_s=self._queued,
            stop_sequence=stops.matched,
            restore_steps=_in_order(report.steps) if report is not None else (),
            prompt_s=self._prompt_s,
        )

    def _work(self) -> tuple[int, ...]:
        """State captures, tokenize calls and characters tokenized, template renders and
        characters rendered, so far."""
        renders, rendered, calls, tokenized = self.runtime.template.work()
        return STATE_WORK.captures, calls, tokenized, renders, rendered

    def _work_since(self) -> tuple[int, ...]:
        return tuple(a - b for a, b in zip(self._work(), self._work_at, strict=True))

    # --------------------------------------------------------- pre-warm, list
    def prefill(self, body: dict[str, Any]) -> dict[str, object]:
        """``POST /v1/localkv/prefill``: what ``localkv prefill --json`` prints, and whether
        the pin asked for was made (a client's: within the clients' share of the budget)."""
        asked = prefill_body(body)
        documents, system = asked.documents, asked.system
        budget = Budget(self.runtime.session.n_ctx, param="documents")  # no answer follows
        budget.before_chars(0, len(system or "") + sum(len(d.text) for d in documents))
        pin = ClientPin() if asked.pin else False
        try:
            report = self.runtime.prefill(documents, system=system, label=asked.label, pin=pin)
        except ContextFullError as exc:
            raise budget.too_long(exc.needed, exact=True) from None
        except ValueError as exc:
            raise ApiError(
                413, str(exc), param="documents", code="context_length_exceeded"
            ) from None
        cache = self.runtime.cache
        made = cache is not None and pinned(cache, report.snapshot)
        return {
            **report.as_json(),
            "pinned": made,
            "not_pinned": _not_pinned(report.snapshot) if pin and not made else None,
            "cache": _cache_json(report.cache.hit, report.cache.verified, report.cache.miss_reason),
        }

    def snapshots(self) -> list[dict[str, object]]:
        """The namespace's snapshots as ``/v1/localkv/cache`` lists them, once saves are done."""
        self.runtime.wait_for_saves()
        return [snap.as_json() for snap in self.runtime.snapshots()]


def model_facts(runtime: Runtime, model_id: str) -> ModelFacts:
    """What the protocols may say of the loaded model, read once."""
    session = runtime.session
    path = session.config.model_path
    stat = os.stat(path)
    family = session.meta("general.architecture") or ""
    keys = ["general.architecture", "general.name", "general.size_label", "general.file_type"]
    keys += [f"{family}.{k}" for k in ("context_length", "embedding_length", "block_count")]
    metadata = {key: value for key in keys if (value := session.meta(key)) is not None}
    choice = runtime.template.choice
    # the Jinja text; a llama.cpp built-in format has none, only its name
    template = choice.jinja if choice.jinja is not None else choice.template.decode("utf-8")
    return ModelFacts(
        model_id=model_id,
        path=str(path),
        size=stat.st_size,
        modified=stat.st_mtime,
        digest=runtime.cache.identity.model_sha256 if runtime.cache is not None else "",
        n_params=int(llama_cpp.llama_model_n_params(session.model)),
        n_ctx=session.n_ctx,
        template=template,
        metadata=metadata,
    )


def _in_order(steps: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    """A restore's steps in the order they run (``RESTORE_STEPS``), any other after them."""
    known = [(name, steps[name]) for name in RESTORE_STEPS if name in steps]
    return (*known, *((k, v) for k, v in steps.items() if k not in RESTORE_STEPS))


def _source(report: CacheReport) -> str:
    """Where a restore took the reused tokens from: a state held in memory, or the disk."""
    return "memory" if report.held else "disk"


def _sender(stops: StopText, emit: TextFn) -> TextFn:
    def send(piece: str) -> None:
        out = stops.push(piece)
        if out:
            emit(out)

    return send


def _log_work(now: tuple[int, ...], before: tuple[int, ...], n_messages: int) -> None:
    renders, rendered, calls, tokenized = (a - b for a, b in zip(now, before, strict=True))
    log.debug(
        "prompt of %d messages: %d renders (%d characters), %d tokenize calls (%d characters)",
        n_messages,
        renders,
        rendered,
        calls,
        tokenized,
    )


def _not_pinned(snapshot: str | None) -> str:
    """Why a pin asked for through the server was not made."""
    if snapshot is None:
        return "not pinned: the prefix was not saved (see not_kept, not_saved)"
    return (
        f"not pinned: the pins of the server's clients would hold more than their share of "
        f"the cache budget ({ENV_CLIENT_PINS}); saved unpinned, evicted first"
    )


def _cache_json(hit: bool, verified: bool | None, miss_reason: str | None) -> dict[str, object]:
    return {"hit": hit, "verified": verified, "miss_reason": miss_reason}
