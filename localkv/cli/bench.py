"""``localkv bench``: measure cold and restored time to first token on this machine.

The command reads its options, runs ``localkv.bench.run.run_bench`` and writes
what ``localkv.bench.report`` makes of the result. This module is imported only
when ``bench`` runs (``localkv.cli.COMMANDS``); matplotlib only when the chart
is drawn (``report.write_chart``). Also runnable on its own:
``python -m localkv.cli.bench [OPTIONS]``.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from collections.abc import Callable
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console

from localkv.bench import report as benchreport
from localkv.bench.run import BenchConfig, BenchResult, run_bench
from localkv.cli.options import flash_attn_option
from localkv.model.find import ModelNotFoundError, resolve_model
from localkv.model.session import ModelLoadError

__all__ = ["bench", "parse_sizes"]

DOCS_CHART_NAME = "benchmarks-ttft.png"


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"512,2048,8192"`` -> ``(512, 2048, 8192)`` (sorted, each at least 2)."""
    try:
        sizes = tuple(sorted({int(x) for x in text.replace(" ", "").split(",") if x}))
    except ValueError:
        raise click.BadParameter(f"not a list of token counts: {text!r}") from None
    if not sizes or sizes[0] < 2:
        raise click.BadParameter(f"sizes must be at least 2 tokens each: {text!r}")
    return sizes


def _command_line(ctx: click.Context) -> str:
    """``localkv bench`` and the options given on the command line, reproducibly."""
    parts = ["localkv", "bench"]
    for param in ctx.command.params:
        name = param.name
        if name is None or ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE:
            continue
        flag = param.opts[0]
        value = ctx.params[name]
        if isinstance(param, click.Option) and param.is_flag:
            parts.append(flag)
        else:
            parts += [flag, str(value)]
    return " ".join(shlex.quote(p) for p in parts)


@click.command()
@click.option(
    "--model",
    metavar="PATH",
    help="GGUF file (default: LOCALKV_MODEL, then the default model package).",
)
@click.option(
    "--sizes",
    default="512,2048,8192",
    show_default=True,
    help="Prompt lengths in tokens, comma-separated (n_ctx is the largest + 64).",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Runs of each quick measurement (restores, state files, floor); median, min, max.",
)
@click.option(
    "--cold-repeats",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Runs of each full prefill (cold TTFT; ask with the cache on and off).",
)
@click.option(
    "--lookup-blocks",
    type=click.IntRange(min=0),
    default=10_000,
    show_default=True,
    help="Blocks indexed for the longest-prefix lookup test (0: skip it).",
)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads.")
@flash_attn_option
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-results"),
    show_default=True,
    help=f"Directory for {benchreport.RESULTS_NAME} and the {benchreport.CHART_NAME} chart.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
@click.option(
    "--write-docs",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="PATH",
    help="Regenerate this markdown page (e.g. docs/performance/benchmarks.md) with the results.",
)
@click.pass_context
def bench(  # noqa: PLR0913, PLR0917 - click passes each option by parameter
    ctx: click.Context,
    model: str | None,
    sizes: str,
    repeats: int,
    cold_repeats: int,
    lookup_blocks: int,
    threads: int | None,
    flash_attn: str,
    out: Path,
    as_json: bool,
    write_docs: Path | None,
) -> None:
    """Measure time to first token: cold prefill against a verified restore from disk.

    For each prompt length it also runs llama.cpp's own state files,
    llama-cpp-python's LlamaDiskCache and the physical floor (raw state bytes
    into llama.cpp); repeats the restores with the files dropped from the page
    cache (checked in /proc/self/io); repeats them from compact block files
    (--compact-cache: the high bytes in a 6-bit code); compares the block
    encodings (raw, zstd, high-byte plane + zstd or + the 6-bit code: bytes
    and decode time); and reports bytes on disk, save time, peak memory and
    the lookup time with many blocks indexed. Caches live in a temporary
    directory. Every prompt length is prefilled several times over, so a run
    with the defaults takes minutes: run it on an otherwise idle machine.
    """
    cfg = _config(
        model, sizes, repeats, cold_repeats, lookup_blocks, threads=threads, flash_attn=flash_attn
    )
    command = _command_line(ctx)
    say = _progress()
    say(f"{command}: model {cfg.model_path.name}, sizes {', '.join(map(str, cfg.sizes))}")
    try:
        result = run_bench(cfg, say)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from None
    _write_results(result, out, command, as_json, say)
    if write_docs is not None:
        _write_docs(result, command, write_docs, say)


def _config(  # noqa: PLR0913 - each option of the command
    model: str | None,
    sizes: str,
    repeats: int,
    cold_repeats: int,
    lookup_blocks: int,
    *,
    threads: int | None,
    flash_attn: str = "auto",
) -> BenchConfig:
    """The run's settings from the options; a model that cannot be found is a usage error."""
    try:
        return BenchConfig(
            model_path=resolve_model(model),
            sizes=parse_sizes(sizes),
            cold_repeats=cold_repeats,
            repeats=repeats,
            lookup_blocks=lookup_blocks,
            n_threads=threads,
            flash_attn=flash_attn,
        )
    except ModelNotFoundError as exc:
        raise click.ClickException(str(exc)) from None


def _progress() -> Callable[[str], None]:
    """A progress line on stderr, stamped with the seconds since this call."""
    t0 = time.perf_counter()

    def say(line: str) -> None:
        click.echo(f"[{time.perf_counter() - t0:6.1f} s] {line}", err=True)

    return say


def _write_results(
    result: BenchResult, out: Path, command: str, as_json: bool, say: Callable[[str], None]
) -> None:
    """The JSON and the chart under ``out``; the results on stdout (JSON or a table)."""
    results_path = benchreport.write_json(result, out / benchreport.RESULTS_NAME, command)
    why_no_chart = benchreport.write_chart(result, out / benchreport.CHART_NAME)
    if as_json:
        click.echo(json.dumps(benchreport.as_json(result, command), indent=2))
    else:
        console = Console()
        console.print(benchreport.rich_table(result))
        line = benchreport.lookup_line(result)
        if line:
            console.print(line)
    say(f"wrote {results_path}")
    if why_no_chart:
        say(why_no_chart)
    else:
        say(f"wrote {out / benchreport.CHART_NAME}")


def _write_docs(result: BenchResult, command: str, path: Path, say: Callable[[str], None]) -> None:
    """The markdown page at ``path``, with its chart beside it when matplotlib can draw it."""
    chart = path.parent / DOCS_CHART_NAME
    docs_chart = None if benchreport.write_chart(result, chart) else chart.name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(benchreport.markdown(result, command, docs_chart), encoding="utf-8")
    say(f"wrote {path}" + (f" and {chart}" if docs_chart else ""))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("localkv.llama").setLevel(logging.ERROR)
    bench(prog_name="localkv bench")
