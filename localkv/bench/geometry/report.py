"""The geometry benchmark's results as JSON and as a markdown table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["derived", "markdown"]

KIB = 1024


def derived(f: Mapping[str, Any]) -> dict[str, float]:
    """The ratios and rates of one result (``measure.Figures.as_json``)."""
    tokens = max(1, int(f["tokens"]))
    rows = max(1, int(f["rows_once"]))
    restore_s = float(f["restore_s"]) or float("nan")
    return {
        "disk_per_token": f["disk"] / tokens,
        "disk_over_rows_once": f["disk"] / rows,
        "disk_over_llama_state_file": f["disk"] / max(1, int(f["llama_state_file"])),
        "written_per_token": f["written"] / tokens,
        "written_over_rows_once": f["written"] / rows,
        "restore_read_over_needed": f["restore_read"] / max(1, int(f["needed"])),
        "restore_gb_s": f["needed"] / restore_s / 1e9,
        "memcpy_gb_s": f["needed"] / max(1e-12, float(f["memcpy_s"])) / 1e9,
        "save_over_prefill": f["save_s"] / max(1e-12, float(f["prefill_s"])),
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _row(model: str, f: Mapping[str, Any]) -> str:
    d = derived(f)
    cells = [
        model,
        f"{f['tokens']:,}",
        f"{d['disk_per_token'] / KIB:,.0f} KiB",
        f"{_mb(f['disk'])} ({d['disk_over_rows_once']:.2f}x)",
        f"{_mb(f['rows_once'])}",
        f"{_mb(f['llama_state_file'])} ({d['disk_over_llama_state_file']:.2f}x)",
        f"{d['written_per_token'] / KIB:,.0f} KiB ({d['written_over_rows_once']:.2f}x)",
        f"{_mb(f['restore_read'])} / {_mb(f['needed'])} ({d['restore_read_over_needed']:.2f}x)",
        f"{d['restore_gb_s']:.2f} / {d['memcpy_gb_s']:.2f} GB/s",
        f"{f['save_s']:.2f} / {f['prefill_s']:.2f} s ({d['save_over_prefill']:.2f}x)",
        f"{f['reused']:,}{'' if f['verified'] else ' (not verified)'}",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| model geometry | tokens | disk per token | on disk (x rows once) | rows once "
    "| llama.cpp state file (disk x it) | written per token (x rows once) "
    "| restore read / needed | restore / memcpy | save / uncached prefill | restored |"
)


def markdown(results: Sequence[Mapping[str, Any]], notes: Sequence[str]) -> str:
    """The table (one row per model and length) and the notes under it."""
    lines = [
        "# Cache at real model geometry",
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
    ]
    lines += [_row(str(r["label"]), r["figures"]) for r in results]
    lines += ["", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)
