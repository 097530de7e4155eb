"""Options shared by the ``localkv`` commands, and turning them into configs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from localkv.model.config import MAX_THREADS
from localkv.model.context import FLOOR, default_context
from localkv.model.find import ModelNotFoundError, resolve_model
from localkv.model.native import GGML_TYPES
from localkv.model.sampling import GrammarError, SamplingParams, json_schema_grammar
from localkv.model.sampling.grammar import MAX_GRAMMAR_CHARS, check_gbnf
from localkv.model.session import LoraSpec, SessionConfig
from localkv.prompt.request import DocumentError, TextError, byte_limit, check_text, read_document
from localkv.prompt.templatechoice import ChatTemplateError, parse_template_option

if TYPE_CHECKING:
    from localkv.runtime import Runtime

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "cache_dir_option",
    "cache_options",
    "flash_attn_option",
    "grammar_options",
    "model_options",
    "namespace_option",
    "open_runtime",
    "sampling_options",
    "sampling_params",
    "session_config",
    "system_option",
    "system_text",
    "text_value",
]


_KV_TYPES = click.Choice(sorted(GGML_TYPES), case_sensitive=False)
flash_attn_option = click.option(
    "--flash-attn",
    type=click.Choice(["on", "off", "auto"]),
    default="auto",
    show_default=True,
    help="Flash attention. auto: off on a CPU while its scratch stays under 1 GiB "
    "(it is faster there), else llama.cpp decides; off keeps V transposed in llama.cpp's "
    "cache. With it on, the thread count is part of the cache identity.",
)

_MODEL_OPTIONS = [
    click.option(
        "--model",
        "model",
        metavar="PATH|NAME",
        help="GGUF file, or a name `localkv models` lists (gemma3:270m for an Ollama "
        "model, the file stem otherwise). Default: LOCALKV_MODEL, then the default "
        "model package.",
    ),
    click.option(
        "--chat-template",
        "chat_template",
        metavar="NAME|FILE",
        callback=lambda ctx, param, value: _chat_template(value),
        help="Chat format: a llama.cpp built-in name (chatml, gemma, llama3, llama2, "
        "phi3, phi4, mistral-v7, ...) or a Jinja template file, rendered as Hugging "
        "Face renders it. Default: the model's own; for a model without one, the "
        "format of its architecture (with a warning).",
    ),
    click.option(
        "--ctx",
        "n_ctx",
        type=click.IntRange(min=256, max=2**24),
        callback=lambda ctx, param, value: _context(ctx, value),
        help="Context length in tokens, 256 to 16,777,216; llama.cpp rounds it up to "
        "a multiple of 256 and needs memory for all of it. Default: the length the "
        "model was trained for (its GGUF context_length), lowered until its KV cache "
        "(f16) fits in a quarter of the available memory, never below 4,096.",
    ),
    click.option(
        "--n-gpu-layers",
        type=int,
        default=-1,
        show_default=True,
        help="Layers to offload to a GPU (-1: all; no effect on CPU builds).",
    ),
    click.option(
        "--type-k",
        type=_KV_TYPES,
        default="f16",
        show_default=True,
        help="KV cache type for keys.",
    ),
    click.option(
        "--type-v",
        type=_KV_TYPES,
        default="f16",
        show_default=True,
        help="KV cache type for values (quantized types need flash attention).",
    ),
    flash_attn_option,
    click.option(
        "--lora",
        "loras",
        multiple=True,
        metavar="PATH[:SCALE]",
        help="LoRA adapter, repeatable.",
    ),
    click.option(
        "--threads",
        type=click.IntRange(min=1, max=MAX_THREADS),
        default=None,
        help=(
            f"CPU threads, 1 to {MAX_THREADS} (llama.cpp's limit; default: one per core"
            " that other work leaves free, all of them on an idle machine)."
        ),
    ),
]


def _chat_template(value: str | None) -> str | None:
    """Refuse an unknown name or an unusable file before the model loads."""
    if value is not None:
        try:
            parse_template_option(value)
        except ChatTemplateError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def text_value(value: str | None, what: str) -> str | None:
    """``value`` if it can be a prompt's text (``check_text``), else a usage error (exit 2).

    Arguments come from the command line as Python decoded them: bytes that are
    not UTF-8 arrive as lone surrogates, which no prompt or SQLite row can hold.
    """
    if value is not None:
        try:
            check_text(value, what)
        except TextError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def _context(ctx: click.Context, value: int | None) -> int:
    """``--ctx``, else the model's own context (``localkv.model.context``). ``--model``
    is processed first: click takes the options given, then the rest in order."""
    if value is not None:
        return value
    try:
        model = resolve_model(ctx.params.get("model"))
    except ModelNotFoundError:
        return FLOOR  # the command says why when it opens the model
    return default_context(model)


def _system(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--system TEXT`` checked as text; ``@FILE`` names a file, read when the command runs."""
    if value is not None and value.startswith("@"):
        return value
    return text_value(value, "the system prompt")


def system_text(value: str | None, n_ctx: int) -> str | None:
    """``--system TEXT`` or ``--system @FILE`` (read as a document is, within the context)."""
    if value is None or not value.startswith("@"):
        return value
    try:
        return read_document(value[1:], max_bytes=byte_limit(n_ctx)).text
    except DocumentError as exc:
        raise click.BadParameter(f"cannot read the system prompt file: {exc}") from None


def system_option(help: str) -> Callable[[F], F]:
    """``--system``, its text checked before any work."""
    return click.option("--system", default=None, callback=_system, help=help)


def _namespace(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A namespace names entries in the index: not empty, and text."""
    if value is not None and not value.strip():
        raise click.BadParameter("a namespace cannot be empty")
    return text_value(value, "the namespace")


def model_options(func: F) -> F:
    """Options shared by every command that loads a model."""
    for opt in reversed(_MODEL_OPTIONS):
        func = opt(func)
    return func


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """Refuse NaN and infinities, which pass a FloatRange."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


_DEFAULT = SamplingParams()


def sampling_options(func: F) -> F:
    opts = [
        click.option(
            "--temperature",
            type=click.FloatRange(min=0),
            callback=_finite,
            default=0.7,
            show_default=True,
            help="0 picks the most likely token.",
        ),
        click.option(
            "--top-p",
            type=click.FloatRange(min=0, max=1, min_open=True),
            callback=_finite,
            default=0.95,
            show_default=True,
        ),
        click.option(
            "--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="0: off."
        ),
        click.option(
            "--seed",
            type=click.IntRange(min=0),
            default=None,
            help="Seed for repeatable sampling (0 or more).",
        ),
        click.option(
            "--min-p",
            type=click.FloatRange(min=0, max=1, max_open=True),
            callback=_finite,
            default=_DEFAULT.min_p,
            show_default=True,
            help="Drop tokens less likely than this fraction of the likeliest one (0: off).",
        ),
        click.option(
            "--repeat-penalty",
            type=click.FloatRange(min=0, min_open=True),
            callback=_finite,
            default=_DEFAULT.repeat_penalty,
            show_default=True,
            help=f"Penalize tokens seen in the last {_DEFAULT.repeat_last_n} (prompt "
            "included), at temperature 0 too (1: off); keeps small models from looping.",
        ),
        click.option(
            "--max-tokens",
            type=click.IntRange(min=1),
            default=512,
            show_default=True,
            help="Longest answer in tokens.",
        ),
    ]
    for opt in reversed(opts):
        func = opt(func)
    return func


def session_config(opts: dict[str, Any]) -> SessionConfig:
    try:
        model = resolve_model(opts.get("model"))
    except ModelNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    return SessionConfig(
        model_path=model,
        n_ctx=opts["n_ctx"],
        n_gpu_layers=opts["n_gpu_layers"],
        type_k=opts["type_k"].lower(),
        type_v=opts["type_v"].lower(),
        flash_attn=opts["flash_attn"],
        loras=tuple(LoraSpec.parse(x) for x in opts.get("loras", ())),
        n_threads=opts.get("threads"),
        chat_template=opts.get("chat_template"),
    )


def open_runtime(opts: dict[str, Any]) -> Runtime:
    """The runtime the model and cache options describe; ``ModelLoadError`` if it fails.

    A model that cannot be found is a ``click.ClickException`` (from
    ``session_config``), raised before anything loads.
    """
    from localkv.runtime import Runtime  # imported when a command runs, not on --help

    return Runtime(
        session_config(opts),
        cache_dir=opts.get("cache_dir"),
        namespace=opts["namespace"],
        use_cache=not opts["no_cache"],
        compact_cache=opts["compact_cache"],
    )


def sampling_params(opts: dict[str, Any]) -> SamplingParams:
    """The sampling options as values; ``--json-schema`` and ``--grammar`` as GBNF."""
    if opts.get("json_schema") is not None and opts.get("grammar") is not None:
        raise click.UsageError("give --json-schema or --grammar, not both")
    return SamplingParams(
        temperature=opts["temperature"],
        top_p=opts["top_p"],
        top_k=opts["top_k"],
        seed=opts["seed"],
        max_tokens=opts["max_tokens"],
        min_p=opts["min_p"],
        repeat_penalty=opts["repeat_penalty"],
        grammar=opts.get("json_schema") or opts.get("grammar"),
    )


def _read_text(param: click.Parameter, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(MAX_GRAMMAR_CHARS + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"cannot read {path}: {exc}", param=param) from None


def _schema_file(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return json_schema_grammar(_read_text(param, path))
    except GrammarError as exc:
        raise click.BadParameter(f"{path}: {exc}", param=param) from None


def _grammar_file(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return check_gbnf(_read_text(param, path))
    except GrammarError as exc:
        raise click.BadParameter(f"{path}: {exc}", param=param) from None


def grammar_options(func: F) -> F:
    """``--json-schema FILE`` and ``--grammar FILE``: what the answer must look like."""
    path = click.Path(exists=True, dir_okay=False)
    opts = [
        click.option(
            "--json-schema",
            type=path,
            callback=_schema_file,
            help="Answer with JSON valid against the JSON schema in FILE (by grammar).",
        ),
        click.option(
            "--grammar",
            type=path,
            callback=_grammar_file,
            help="Answer in the GBNF grammar in FILE (llama.cpp's grammar format).",
        ),
    ]
    for opt in reversed(opts):
        func = opt(func)
    return func


def namespace_option(default: str | None = None) -> Callable[[F], F]:
    """``--namespace`` of the ``cache`` commands that list: only this namespace."""
    return click.option(
        "--namespace",
        default=default,
        show_default=default is not None,
        callback=_namespace,
        help="Only this namespace.",
    )


cache_dir_option = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Cache directory (default: LOCALKV_HOME, then the user cache dir).",
)


def cache_options(func: F) -> F:
    """Where the cache lives and whether to use it."""
    opts = [
        cache_dir_option,
        click.option(
            "--namespace",
            default="default",
            show_default=True,
            callback=_namespace,
            help="Entries of one namespace are never reused by another.",
        ),
        click.option(
            "--no-cache", is_flag=True, help="Neither restore nor save: compute everything."
        ),
        click.option(
            "--compact-cache",
            is_flag=True,
            envvar="LOCALKV_COMPACT_CACHE",
            help="Write new cache blocks compact: less disk space, slower restores "
            "(measured in docs/performance/benchmarks.md). Blocks of every kind are read. "
            "[env: LOCALKV_COMPACT_CACHE=1]",
        ),
    ]
    for opt in reversed(opts):
        func = opt(func)
    return func
