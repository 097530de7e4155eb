"""The peer page: localkv beside llama-server, every figure from one run's JSON.

``markdown(data)`` returns the whole page (``docs/performance/peer.md``): the command,
the machine, model and setting, the load average before and after, a table per
prompt length and one for two documents in turn (medians, min-max, the ratio
localkv / llama-server), where localkv's restart time goes (per length, the parts its
server reports), the targets met and missed, and how each figure is taken.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from localkv.bench.peer.figures import (
    Figure,
    alternate_figures,
    length_figures,
    restart_parts,
    targets,
)
from localkv.bench.stats import Stat
from localkv.bench.table import fmt_bytes, fmt_ratio, fmt_stat

__all__ = ["METHOD", "cell", "markdown", "table"]


def cell(stat: Stat, unit: str) -> str:
    """A median (min-max) in the figure's unit; ``-`` where there was no run."""
    if stat.n == 0:
        return "-"
    if unit == "s":
        return fmt_stat(stat)
    if unit == "B/token":
        return f"{fmt_bytes(stat.median)}/token"
    if stat.n == 1:
        return f"{stat.median:.3g} {unit}"
    return f"{stat.median:.3g} {unit} ({stat.min:.3g}-{stat.max:.3g})"


def table(figures: Sequence[Figure]) -> list[str]:
    """The rows: figure, the other server, localkv, the other, localkv / other."""
    out = [
        "| figure | against | localkv | against | localkv / against |",
        "|---|---|---:|---:|---:|",
    ]
    for f in figures:
        ratio = "-" if f.ratio is None or f.localkv.n == 0 else fmt_ratio(f.ratio)
        out.append(
            f"| {f.label} | {f.other} | {cell(f.localkv, f.unit)} | {cell(f.peer, f.unit)} "
            f"| {ratio} |"
        )
    return out


def _setting(data: Mapping[str, Any]) -> list[str]:
    m, s, mo = data["machine"], data["setting"], data["model"]
    load = data["load"]
    return [
        f"- machine: {m.get('cpu')}, {m.get('cores')} cores, "
        f"{fmt_bytes(float(m.get('memory_bytes', 0)))} memory; {m.get('os')}",
        f"- load average (1, 5, 15 min): before {load['before']}, after {load['after']} "
        f"({data['seconds']:.0f} s run)",
        f"- model: {mo['name']} ({fmt_bytes(float(mo['file_bytes']))})",
        f"- both servers: n_ctx {s['n_ctx']} a slot, {s['threads']} threads, flash attention "
        f"off, greedy, answers of at most {s['max_tokens']} tokens; {s['repeats']} runs a "
        "figure, interleaved; cells are median (min-max)",
        f"- localkv: `localkv serve` from this checkout, llama-cpp-python "
        f"{m.get('llama_cpp_python')}",
        f"- llama-server: `{data['llama_server']['path']}` "
        f"({data['llama_server']['version']}), built by `make llama-server` from the "
        "llama.cpp that llama-cpp-python vendors",
        "",
    ]


def _targets(data: Mapping[str, Any]) -> list[str]:
    out = []
    for t in targets(data):
        ratio = "-" if t.ratio is None else fmt_ratio(t.ratio)
        sign = ">=" if t.higher_is_better else "<="
        out.append(f"- {t.what}: {ratio} ({sign} {t.bound:g}): {'met' if t.met else 'NOT met'}")
    return out


def _lengths(data: Mapping[str, Any]) -> list[str]:
    out = []
    for length in data["lengths"]:
        prompts = sorted({r["prompt_tokens"] for r in length["cold"]["localkv"]})
        theirs = sorted({r["prompt_tokens"] for r in length["cold"]["llama-server"]})
        out += [
            f"### A document of {length['tokens']:,} tokens",
            "",
            f"Prompt tokens as each server counted them: localkv {prompts}, llama-server {theirs}.",
            "",
            *table(length_figures(length)),
            "",
        ]
    return out


def _restart_parts(data: Mapping[str, Any]) -> list[str]:
    """Per length, localkv's restart part by part beside llama-server's slot restore."""
    out = [
        "## Where localkv's restart time goes",
        "",
        "The first token after a restart, split into the parts localkv's server reports for "
        "each run (`localkv.prompt_ms`, `localkv.restore_steps`), beside llama-server's slot "
        "restore call and its request; medians over the runs (min-max), each part's median "
        "on its own, so they need not add up to the median first token.",
        "",
    ]
    for length in data["lengths"]:
        out += [
            f"### A document of {length['tokens']:,} tokens, after a restart",
            "",
            "| part | localkv | llama-server |",
            "|---|---:|---:|",
            *(
                f"| {p.label} | {cell(p.localkv, 's')} | {cell(p.peer, 's')} |"
                for p in restart_parts(length)
            ),
            "",
        ]
    return out


def _alternate(data: Mapping[str, Any]) -> list[str]:
    alt = data.get("alternate")
    if not alt:
        return []
    return [
        f"### Two documents of {alt['tokens']:,} tokens in turn, in one running server",
        "",
        *table(alternate_figures(alt["runs"])),
        "",
    ]


def markdown(data: Mapping[str, Any]) -> str:
    """The whole page."""
    lines = [
        "# localkv beside llama.cpp's own server",
        "",
        "<!-- Generated by `python -m localkv.bench.peer`; do not edit by hand. -->",
        "",
        f"Generated {data['started']} by:",
        "",
        "```",
        data["command"],
        "```",
        "",
        *_setting(data),
        "## Results",
        "",
        "localkv / against is the ratio of the medians: below 1 localkv takes less time "
        "(or bytes); for a decode rate, above 1 localkv is faster.",
        "",
        *_lengths(data),
        *_alternate(data),
        *_restart_parts(data),
        "## Targets",
        "",
        *_targets(data),
        "",
        "## How each figure is measured",
        "",
        *METHOD,
        "",
    ]
    return "\n".join(lines)


METHOD = [
    "- Every request is a streamed OpenAI chat completion (`stream_options.include_usage`) "
    "from this process: the system prompt is a document of N tokens of the bench text "
    "(`localkv.bench.text`) under a heading, the user message a question. **first token**: "
    "seconds from sending the request to the first chunk with content, as the client sees it.",
    "- **cold**: per run, each server started afresh (`localkv serve --no-cache`; "
    "llama-server with its RAM prompt cache, which a restart empties), the request, the "
    "server stopped; the servers in turn, the first alternating. **server CPU**: the "
    "server process's user and system time over the request (`/proc/PID/stat`), prefill and "
    "the answer's decode. **decode**: the answer's tokens after the first over the seconds "
    "from the first content chunk to the last, as received. **prefill, the server's own "
    "time**: llama-server's `timings.prompt_ms`; localkv's `localkv.ttft_ms` (from the "
    "start of the request's work to its first token).",
    "- **restart**: each server answers the request once (localkv saves its blocks; "
    "llama-server's slot 0 is saved with `POST /slots/0?action=save`) and stops; localkv "
    "is started once more and answers it again, restoring the chain from its blocks, "
    "which packs it (`localkv/cache/restore/packed.py`: llama.cpp's state stream in one "
    "file, written after the answer), as a chain used again is; then per "
    "run localkv is started again over its cache and the same request sent, and "
    "llama-server is started again with `--slot-save-path`, its slot restored with "
    "`POST /slots/0?action=restore` (timed) and the same request sent. "
    "**--cache-ram (re-prefill)** is llama-server's cold runs: a restart empties its RAM "
    "cache, so the same request after a restart is a cold prefill.",
    "- **where localkv's restart time goes**: each restart run's own `localkv` object, from "
    "the response that answered the request. **prompt build**: `prompt_ms`, the template's "
    "render and the tokenizing. The restore's steps (`restore_steps`), one after another: "
    "**lookup**, the index lookup of the stored chain; **read, columns excluded**, the block "
    "files read and their checksums and chain hashes checked, less the columns (through "
    "the packed state: the file mapped); **V into "
    "columns**, V's rows copied into llama.cpp's transposed layout (flash attention off) on "
    "the reader threads, their seconds summed over the threads (where they overlap, the "
    "read's row is what is left of its wall time); **load into llama.cpp**, "
    "`llama_state_seq_set_data` of each piece (through the packed state: of the mapping, "
    "its checksum checked beside it on a reader thread); **probe**, the one-token decode that "
    "verifies the restored state. **restore, all its steps**: `restore_ms`, lookup to "
    "probe. **the rest of the first token**: the client's first token less the parts "
    "named above: the request's HTTP, parse and queue, the prefill of the prompt's tail "
    "after the restored prefix, the first token's sampling and its chunk's trip back. "
    "llama-server's column: its slot restore call (`POST /slots/0?action=restore`, as the "
    "client timed it) beside localkv's whole restore, its request alone beside localkv's "
    "rest, and both beside localkv's first token.",
    "- **bytes on disk per token**: localkv's block files (`*.lkv`) after the first request "
    "over the tokens its longest snapshot holds (`GET /v1/localkv/cache`); the slot file's "
    "bytes over the tokens llama-server saved in it (`n_written` / `n_saved`); both hold the "
    "prompt and the answer. **packed state too**: the same with localkv's packed state "
    "(`packed/*.state`, written by the fill's restore from the blocks) added to its block "
    "files.",
    "- **two documents in turn**: three servers running side by side: localkv, llama-server "
    "with one slot and its RAM prompt cache (`--cache-ram` at its default size), and "
    "llama-server with two slots (`-np 2`, each of the full context). Turns alternate "
    "document A and B, each with a question no earlier turn asked, sent to each server in "
    "turn (the first rotating); the first turn of each document is a cold prefill and is "
    "not counted.",
]
