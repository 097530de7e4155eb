"""``localkv models``: the GGUF models on this machine, and whether the cache can hold them."""

from __future__ import annotations

import dataclasses
import json

import click

from localkv.model.find import ModelInfo, count_label, describe, find_models
from localkv.runtime.reports import printable

__all__ = ["models"]

_SOURCES = {"LOCALKV_MODELS": "dir", "huggingface": "hf"}
_MEMORY = {"sliding-window": "sliding"}
# (title, width); the row is at most 80 columns
_COLUMNS = (
    ("NAME", 22),
    ("SOURCE", 8),
    ("ARCH", 8),
    ("PARAMS", 6),
    ("QUANT", 7),
    ("SIZE", 8),
    ("MEMORY", 9),
    ("CACHE", 5),
)

_EPILOG = """\b
Sources, where present: the default model package; LOCALKV_MODELS directories
(separated by ':'); LM Studio (~/.lmstudio/models, ~/.cache/lm-studio/models);
Ollama (OLLAMA_MODELS or ~/.ollama/models); the Hugging Face hub cache
($HF_HOME/hub or ~/.cache/huggingface/hub).

\b
MEMORY is what the model keeps per sequence, from its GGUF metadata: attention
(a plain KV cache), sliding (sliding-window layers), hybrid, recurrent. CACHE
says what `localkv prefill` does: yes, it saves the document's blocks; no, it
exits 1 with the reason --json's cache_refusal gives. Every kind is cached (a
sliding window or recurrent state is kept at snapshot points; M-RoPE models too),
except a hybrid with sliding-window layers and architectures whose memory is of
another kind (a sparse-attention indexer cache, no KV memory, a draft model).
--model NAME loads a model by the name listed here; --json gives every field
and the file paths, with the long names the columns shorten: SOURCE dir is
"LOCALKV_MODELS", hf is "huggingface"; MEMORY sliding is "sliding-window"."""


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
    click.echo(_row([title for title, _ in _COLUMNS]))
    for info in infos:
        name_width = _COLUMNS[0][1]
        if len(info.found.name) > name_width:  # a name is never cut: it is what --model takes
            click.echo(printable(info.found.name))
            info = dataclasses.replace(info, found=dataclasses.replace(info.found, name=""))
        click.echo(_row(_cells(info)) if info.error is None else _error_row(info))


def _cells(info: ModelInfo) -> list[str]:
    return [
        info.found.name,
        _source(info),
        info.architecture or "?",
        count_label(info.parameters),
        info.quantization or "?",
        _bytes(info.size),
        _MEMORY.get(info.memory, info.memory),
        "yes" if info.cacheable else "no",
    ]


def _source(info: ModelInfo) -> str:
    return _SOURCES.get(info.found.source, info.found.source)


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _row(cells: list[str]) -> str:
    out = []
    for cell, (title, width) in zip(cells, _COLUMNS, strict=True):
        text = _fit(printable(cell), width)
        out.append(text.rjust(width) if title in ("PARAMS", "SIZE") else text.ljust(width))
    return " ".join(out).rstrip()


def _error_row(info: ModelInfo) -> str:
    """Name and source, then why the header could not be read, in the other columns."""
    head = _row([info.found.name, _source(info)] + [""] * (len(_COLUMNS) - 2))
    start = sum(width + 1 for _, width in _COLUMNS[:2])
    return head.ljust(start) + _fit(printable(f"unreadable: {info.error}"), 80 - start)


def _bytes(n: int) -> str:
    """Binary units, as every other size localkv prints: ``93.8 MiB``, ``1.21 GiB``."""
    size, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1000:
            break
        size, unit = size / 1024, bigger
    return f"{n} B" if unit == "B" else f"{size:.3g} {unit}"
