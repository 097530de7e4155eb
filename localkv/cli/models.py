"""``localkv models``: the GGUF models on this machine, and whether the cache can hold them."""

from __future__ import annotations

import dataclasses
import json

import click

from localkv.model.find import ModelInfo, count_label, describe, find_models
from localkv.runtime.reports import printable

__all__ = ["models"]

# (title, widest cell); the NAME column takes what the others leave of 80 columns
_COLUMNS = (
    ("NAME", 0),
    ("SOURCE", len("LOCALKV_MODELS")),
    ("ARCH", 8),
    ("PARAMS", 6),
    ("QUANT", 7),
    ("SIZE", 8),
    ("MEMORY", len("sliding-window")),
    ("CACHE", 5),
)
_LINE = 80

_EPILOG = """\b
Sources, where present: the default model package; other installed packages
that ship a GGUF file (package: one in parts is joined once, into
~/.local/share/localkv/models, when first loaded); LOCALKV_MODELS directories
(separated by ':'); LM Studio (~/.lmstudio/models, ~/.cache/lm-studio/models);
Ollama (OLLAMA_MODELS or ~/.ollama/models); the Hugging Face hub cache
($HF_HOME/hub or ~/.cache/huggingface/hub).

MEMORY is what the model keeps per sequence, from its GGUF metadata: attention
(a plain KV cache), sliding-window (layers that attend to a window), hybrid,
recurrent. CACHE says what `localkv prefill` does: yes, it saves the document's blocks; no, it
exits 1 with the reason --json's cache_refusal gives. Every kind is cached (a
sliding window or recurrent state is kept at snapshot points; M-RoPE models too),
except a hybrid with sliding-window layers and architectures whose memory is of
another kind (a sparse-attention indexer cache, no KV memory, a draft model).
--model NAME loads a model by the name listed here (a name too long for its
column has a line of its own); --json gives every field and the file paths:
SOURCE is "source", MEMORY "memory", CACHE "cacheable", with the same words;
context_length is what the model was trained for, ctx the context a command
opens without --ctx (see --ctx in `localkv ask --help`)."""


@click.command(epilog=_EPILOG)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def models(as_json: bool) -> None:
    """List the GGUF models found on this machine (LM Studio, Ollama, Hugging Face cache)."""
    infos = [describe(found) for found in find_models()]
    if as_json:
        click.echo(json.dumps({"models": [info.as_json() for info in infos]}))
        return
    if not infos:
        click.echo("no models found (see `localkv models --help` for where they are looked for)")
        return
    widths = _widths(infos)
    click.echo(_row([title for title, _ in _COLUMNS], widths))
    for info in infos:
        if len(info.found.name) > widths[0]:  # a name is never cut: it is what --model takes
            click.echo(printable(info.found.name))
            info = dataclasses.replace(info, found=dataclasses.replace(info.found, name=""))
        click.echo(_row(_cells(info), widths) if info.error is None else _error_row(info, widths))


def _widths(infos: list[ModelInfo]) -> list[int]:
    """Each column as wide as its title and widest cell; NAME gets the rest of the line."""
    blank = [""] * (len(_COLUMNS) - 2)
    rows = [_cells(i) if i.error is None else [i.found.name, i.found.source, *blank] for i in infos]
    widths = [
        max([len(title)] + [min(len(printable(row[i])), most) for row in rows])
        for i, (title, most) in enumerate(_COLUMNS)
    ]
    widths[0] = _LINE - sum(widths[1:]) - (len(widths) - 1)
    return widths


def _cells(info: ModelInfo) -> list[str]:
    return [
        info.found.name,
        info.found.source,
        info.architecture or "?",
        count_label(info.parameters),
        info.quantization or "?",
        _bytes(info.size),
        info.memory,
        "yes" if info.cacheable else "no",
    ]


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _row(cells: list[str], widths: list[int]) -> str:
    out = []
    for cell, (title, _), width in zip(cells, _COLUMNS, widths, strict=True):
        text = _fit(printable(cell), width)
        out.append(text.rjust(width) if title in ("PARAMS", "SIZE") else text.ljust(width))
    return " ".join(out).rstrip()


def _error_row(info: ModelInfo, widths: list[int]) -> str:
    """Name and source, then why the header could not be read, in the other columns."""
    head = _row([info.found.name, info.found.source] + [""] * (len(_COLUMNS) - 2), widths)
    start = sum(width + 1 for width in widths[:2])
    return head.ljust(start) + _fit(printable(f"unreadable: {info.error}"), _LINE - start)


def _bytes(n: int) -> str:
    """Binary units, as every other size localkv prints: ``93.8 MiB``, ``1.21 GiB``."""
    size, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1000:
            break
        size, unit = size / 1024, bigger
    return f"{n} B" if unit == "B" else f"{size:.3g} {unit}"
