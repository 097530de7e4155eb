"""``localkv prefill`` and ``localkv ask``: document workflows from the command line."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import click

from localkv.cache.budgeting import human_size
from localkv.cache.prefix import SaveResult
from localkv.cli import process_age
from localkv.cli.jsonerrors import JsonErrors, TemplateFailure
from localkv.cli.options import (
    cache_options,
    grammar_options,
    model_options,
    open_runtime,
    sampling_options,
    sampling_params,
    system_option,
    system_text,
    text_value,
)
from localkv.model.native import openmp_settings
from localkv.model.sampling import GrammarError
from localkv.model.session import ContextFullError, ModelLoadError
from localkv.prompt.renderbudget import TemplateRenderError
from localkv.prompt.request import (
    ENCODING_POLICY,
    MAX_BYTES_PER_TOKEN,
    Document,
    DocumentError,
    byte_limit,
    read_document,
)
from localkv.prompt.templatechoice import ChatTemplateError
from localkv.runtime import Answer, AskCancelled, CacheReport, PrefillReport, Runtime

__all__ = ["ask", "prefill"]


def _documents(files: tuple[str, ...], n_ctx: int) -> list[Document]:
    if list(files).count("-") > 1:
        raise click.BadParameter("standard input (-) can be given once")
    try:
        docs = [read_document(f, max_bytes=byte_limit(n_ctx)) for f in files]
    except DocumentError as exc:
        raise click.ClickException(str(exc)) from None
    for doc in docs:
        if doc.encoding == "latin-1":
            click.echo(f"warning: {doc.name} is not valid UTF-8: read as Latin-1", err=True)
    return docs


def _open_runtime(opts: dict[str, Any]) -> Runtime:
    """The runtime; in a terminal a ``loading MODEL …`` line shows while the model loads."""
    try:
        with _loading(opts):
            return open_runtime(opts)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from None
    except ChatTemplateError as exc:  # the model's own template, refused
        raise TemplateFailure(str(exc)) from None


@contextmanager
def _loading(opts: dict[str, Any]) -> Iterator[None]:
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.markup import escape

    from localkv.runtime.reports import printable

    name = escape(printable(str(opts.get("model") or "the default model")))
    with Console(stderr=True).status(f"loading {name} …"):
        yield


STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


@contextmanager
def _signals_stop() -> Iterator[list[int]]:
    """While active, Ctrl-C, SIGTERM and SIGHUP set a flag (checked between batches).

    The flag holds the signal number (0: none). A second Ctrl-C aborts at once.
    """
    flag = [0]

    def handler(signum: int, frame: object) -> None:
        if flag[0] and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag[0] = signum
        click.echo("\nstopping after the current batch (Ctrl-C again to abort)", err=True)

    wanted = [getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)]
    try:
        previous = {sig: signal.signal(sig, handler) for sig in wanted}
    except ValueError:  # not the main thread
        yield flag
        return
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _progress_bar(total_hint: str) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(
        TextColumn(total_hint),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TextColumn("{task.fields[rate]}"),
        console=Console(stderr=True),
        transient=True,
    )


def progress_rate(done: int, total: int, first: int, elapsed: float) -> str:
    """``1,261 tok/s, 0:00:04 left``: the tokens prefilled since the first report (not those
    restored before it) over the time since, and the time left at that rate; "" until
    a block is done."""
    if done <= first or elapsed <= 0:
        return ""
    rate = (done - first) / elapsed
    left = round((total - done) / rate)
    return f"{rate:,.0f} tok/s, {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d} left"


class _Progress:
    """Adapts the runtime's progress(done, total) calls to a rich progress bar."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.bar = _progress_bar(label) if enabled else None
        self.task: Any = None
        self.start = 0.0
        self.first = 0  # tokens done at the first report (restored, not prefilled here)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            return
        if self.task is None:
            self.start, self.first = time.perf_counter(), done
            self.task = self.bar.add_task("prefill", total=total, rate="")
        rate = progress_rate(done, total, self.first, time.perf_counter() - self.start)
        self.bar.update(self.task, completed=done, rate=rate)


class _AskProgress:
    """What a cold ``ask`` tells before and while it prefills, on stderr.

    ``prefilling N tokens (not cached yet)`` first; then on a terminal the bar
    ``prefill`` shows, gone before the answer streams; without one a line
    every ``LINE_S`` seconds.
    """

    LINE_S = 5.0

    def __init__(self, terminal: bool, block_size: int) -> None:
        self.terminal, self.block_size = terminal, block_size
        self.bar: _Progress | None = None
        self.last = 0.0
        self.shown = False

    def before(self, report: CacheReport, n: int) -> None:
        """Say what the prefill will do, when it is more than the question's own tokens."""
        if report.hit and n <= self.block_size:
            return
        if report.hit:
            why = f"after {report.reused:,} restored"
        else:  # a fault's reason (and its advice) is said once, on the cache line after
            why = report.miss_reason or "not cached"
            why = why if why.startswith("not cached") else "cache miss, reason below"
        click.echo(f"prefilling {n:,} tokens ({why})", err=True)
        self.shown = True
        if self.terminal:
            self.bar = _Progress("prefill", True).__enter__()

    def __call__(self, done: int, total: int) -> None:
        if not self.shown:
            return
        if self.bar is not None:
            self.bar(done, total)
            if done >= total:
                self.close()
        elif time.monotonic() - self.last >= self.LINE_S and done < total:
            self.last = time.monotonic()
            click.echo(f"prefilled {done:,} of {total:,} tokens", err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


_EPILOG = (
    "Several files form one prefix, in the given order; - reads standard input. "
    + ENCODING_POLICY
    + f" No more is read than a context can hold: {MAX_BYTES_PER_TOKEN} bytes per token "
    "of --ctx. --system @FILE is read the same way."
)


@click.command(cls=JsonErrors, epilog=_EPILOG)
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
@system_option("System prompt: TEXT, or @FILE to read it.")
@click.option(
    "--label",
    default=None,
    callback=lambda ctx, param, value: text_value(value, "the label"),
    help="Snapshot label (default: the file names).",
)
@click.option("--pin", is_flag=True, help="Pin the snapshot: eviction never removes it.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
@model_options
@cache_options
def prefill(
    files: tuple[str, ...],
    system: str | None,
    label: str | None,
    pin: bool,
    as_json: bool,
    **opts: Any,
) -> None:
    """Prefill documents once and save their KV state to the cache.

    Later `localkv ask` runs (any process, any day) restore it instead of
    recomputing it. Completed blocks are saved as the prefill goes, so even a
    killed run keeps them. Ctrl-C, SIGTERM and SIGHUP stop after the current
    batch, keep what is complete and say how many tokens that is: what the
    next run restores (exit 130, 143 and 129). A model the cache cannot hold
    (one `localkv models` lists with CACHE no) or a cache that cannot be saved
    to (read-only) is an error with the reason, exit 1.
    """
    docs = _documents(files, opts["n_ctx"])
    system_prompt = system_text(system, opts["n_ctx"])
    runtime = _open_runtime(opts)
    with runtime:
        unsaved = _why_unsaved(runtime, opts["no_cache"])
        if unsaved:
            raise click.ClickException(f"nothing can be saved: {unsaved}")
        show = not as_json and sys.stderr.isatty()
        with _prompt_errors(), _signals_stop() as flag, _Progress("prefill", show) as progress:
            report = runtime.prefill(
                docs,
                system=system_prompt,
                label=label,
                pin=pin,
                progress=progress,
                cancel=lambda: bool(flag[0]),
            )
        unsaved = _why_unsaved(runtime, opts["no_cache"])  # found on the way: a damaged index
        if unsaved:
            raise click.ClickException(f"nothing was saved: {unsaved}")
        note = _cache_note(runtime)
    if report.not_saved and not report.cancelled:  # a full disk, an I/O error
        raise click.ClickException(_not_saved(report))
    _report_prefill(report, as_json)
    if note:
        click.echo(f"warning: {note}", err=True)
    if flag[0]:
        sys.exit(128 + flag[0])  # what was complete is saved; say how the run ended


def _not_saved(report: PrefillReport) -> str:
    """Why a prefill's save failed, and what the cache holds of it after all."""
    held = f"the cache holds {report.kept:,} of its {report.tokens:,} tokens"
    return f"not saved: {report.not_saved}; {held}, no snapshot"


def _why_unsaved(runtime: Runtime, no_cache: bool) -> str | None:
    """Why a prefill could save nothing (no cache for this model, a read-only cache)."""
    if runtime.cache is None:
        return None if no_cache else runtime.cache_error
    if not runtime.cache.saving:
        return runtime.cache.warning() or "the cache cannot be written"
    return None


def _report_prefill(report: PrefillReport, as_json: bool, err: bool = False) -> None:
    """The prefill's report: JSON on stdout, else its lines (on stderr with ``err``)."""
    if as_json:
        click.echo(json.dumps(report.as_json()))
        return
    state = "cancelled: kept" if report.cancelled else "saved"
    done = report.kept
    if report.not_kept or not (done or report.cancelled):  # --no-cache: nothing kept
        state, done = "prefilled", report.reused + report.prefilled
    new, beside = min(report.new_blocks, report.blocks), report.new_blocks - report.blocks
    extra = f", and {beside} shorter block(s) where a segment ends" if beside > 0 else ""
    click.echo(
        f"{state} {done:,} of {report.tokens:,} tokens "
        f"({report.reused:,} reused, {report.prefilled:,} prefilled) in {report.seconds:.2f} s; "
        f"{report.blocks} blocks ({new} new){extra}, "
        f"{human_size(report.bytes_on_disk)} on disk",
        err=err,
    )
    if report.snapshot:
        click.echo(f"snapshot {report.snapshot}", err=err)
    elif report.not_kept:
        click.echo(f"snapshot {report.not_kept}", err=err)
    if report.over_budget:
        click.echo(f"warning: {report.over_budget}", err=True)


@click.command(cls=JsonErrors, epilog=_EPILOG)
@click.argument("files", nargs=-1, required=True, metavar="FILE... QUESTION")
@system_option("System prompt: TEXT, or @FILE to read it.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
@model_options
@sampling_options
@grammar_options
@cache_options
def ask(files: tuple[str, ...], system: str | None, as_json: bool, **opts: Any) -> None:
    """Ask a question about documents; the answer streams to stdout.

    What the cache holds is restored (and verified) first; the rest is
    prefilled. A prefill beyond the question says so first on stderr
    (`prefilling N tokens (not cached yet)`), then shows the bar `prefill`
    shows in a terminal, or a line every few seconds without one. Ctrl-C,
    SIGTERM and SIGHUP stop the prefill after the current batch, keep the
    blocks complete (the next ask or prefill restores them) and say how many
    tokens that is (exit 130, 143 and 129). A one-line cache report goes to
    stderr, and a line saying so
    when the answer stopped because the context was full or at --max-tokens.
    With --json,
    finish_reason says why the answer ended: stop (the model ended it),
    length (--max-tokens) or context (the context is full). With --json-schema
    or --grammar the answer is sampled under that grammar: JSON the schema
    describes, unless it stopped at --max-tokens first.
    """
    if len(files) < 2:
        raise click.UsageError("give at least one FILE and then the QUESTION")
    *paths, question = files
    if not question.strip():
        raise click.BadParameter("the question is empty")
    text_value(question, "the question")
    docs = _documents(tuple(paths), opts["n_ctx"])
    system_prompt = system_text(system, opts["n_ctx"])
    params = sampling_params(opts)
    runtime = _open_runtime(opts)
    first: list[float] = []  # seconds from the process's start to the answer's first text
    with runtime:
        stream = _first_text(first, None if as_json else lambda p: click.echo(p, nl=False))
        told = _AskProgress(sys.stderr.isatty(), runtime.session.config.block_size)
        try:
            with _prompt_errors(), _signals_stop() as flag:
                answer = runtime.ask(
                    docs,
                    question,
                    system=system_prompt,
                    params=params,
                    on_text=stream,
                    progress=told,
                    cancel=lambda: bool(flag[0]),
                    before_prefill=None if as_json else told.before,
                )
        except GrammarError as exc:  # llama.cpp refused --grammar
            raise click.BadParameter(str(exc), param_hint="'--grammar'") from None
        except AskCancelled as exc:  # what was complete is saved; say how the run ended
            told.close()
            _report_prefill(exc.report, as_json, err=True)
            sys.exit(128 + flag[0])
        finally:
            told.close()
        saves = runtime.wait_for_saves()  # the prompt's blocks, then the budget's eviction
        note = _cache_note(runtime)
    note = None if note == answer.cache.miss_reason else note  # the cache line said it
    _print_answer(answer, runtime, params.max_tokens, first if as_json else None)
    _warn_after(saves[-1] if saves else None, note)
    if flag[0]:  # the answer was cut short by a signal
        sys.exit(128 + flag[0])


def _print_answer(
    answer: Answer, runtime: Runtime, max_tokens: int, first: list[float] | None
) -> None:
    """The answer's JSON (``first``: when its first text came), else its cache line on
    stderr and why it stopped, if it did not end itself."""
    if first is not None:
        data = answer.as_json()
        timing = cast(dict[str, object], data["timing"])
        timing["since_start_s"] = round(first[0], 6) if first else None
        # the wait llama.cpp's threads ran with and why; their count at the end (``ThreadFit``)
        timing |= {"openmp": openmp_settings(), "threads": runtime.session.threads.current}
        click.echo(json.dumps(data))
        return
    click.echo()
    click.echo(answer.cache.line(answer.tokens.prompt), err=True)
    if answer.finish_reason == "context":  # "finish_reason" in --json
        n_ctx = runtime.session.n_ctx
        full = f"answer stopped: the context is full ({n_ctx:,} tokens); raise --ctx"
        click.echo(full, err=True)
    elif answer.finish_reason == "length":
        limit = f"answer stopped at the token limit (--max-tokens {max_tokens:,})"
        click.echo(limit, err=True)


def _warn_after(last: SaveResult | None, note: str | None) -> None:
    """What the prompt's save and the cache said: one warning each, on stderr."""
    if last is not None and last.not_kept:
        click.echo(f"warning: this prompt's cache blocks were {last.not_kept}", err=True)
    if last is not None and last.over_budget:
        click.echo(f"warning: {last.over_budget}", err=True)
    if note:
        click.echo(f"warning: {note}", err=True)


def _first_text(first: list[float], emit: Callable[[str], None] | None) -> Callable[[str], None]:
    """``emit``, noting in ``first`` when the first piece came (``process_age``)."""

    def on_text(piece: str) -> None:
        if not first and piece:
            first.append(process_age())
        if emit is not None:
            emit(piece)

    return on_text


def _cache_note(runtime: Runtime) -> str | None:
    """The cache's one warning (read-only, index lost), read before the runtime closes."""
    return runtime.cache.warning() if runtime.cache is not None else None


@contextmanager
def _prompt_errors() -> Iterator[None]:
    """A prompt the context cannot hold, or the chat template failed on: one line."""
    try:
        yield
    except ContextFullError as exc:
        raise click.ClickException(_too_long(exc)) from None
    except TemplateRenderError as exc:
        raise TemplateFailure(str(exc)) from None


def _too_long(exc: ContextFullError) -> str:
    return (
        f"the input is {exc.needed:,} tokens but the context holds {exc.n_ctx:,}; "
        "raise it with --ctx N or give less text"
    )
