"""``localkv bench`` output: JSON, a terminal table, a markdown page and a PNG chart.

Every figure comes from one ``BenchResult``; the table, the markdown page and
the JSON show the same numbers. The JSON and the chart are written here; the
table is ``benchtable``, the page ``benchmarkdown``, each figure's text
``benchformat``. The chart needs matplotlib (``pip install
'localkv[bench]'``); without it ``write_chart`` says so and writes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from localkv.bench.format import (
    fmt_bytes,
    fmt_cold,
    fmt_encoding,
    fmt_encoding_cold,
    fmt_stat,
)
from localkv.bench.markdown import markdown
from localkv.bench.results import BenchResult, SizeResult
from localkv.bench.table import CELLS, lookup_line, rich_table

# the table, the page and the figures' text are imported from here too
__all__ = [
    "CELLS",
    "CHART_NAME",
    "RESULTS_NAME",
    "as_json",
    "fmt_bytes",
    "fmt_cold",
    "fmt_encoding",
    "fmt_encoding_cold",
    "fmt_stat",
    "lookup_line",
    "markdown",
    "rich_table",
    "write_chart",
    "write_json",
]

RESULTS_NAME = "results.json"
CHART_NAME = "ttft.png"
NO_MATPLOTLIB = "matplotlib is not installed: no chart (pip install 'localkv[bench]')"


# --------------------------------------------------------------------- JSON
def _size_json(s: SizeResult) -> dict[str, object]:
    f, d, a, m = s.llama_file, s.disk_cache, s.ask, s.restore_memory
    return {
        "tokens": s.tokens,
        "cold_ttft_s": s.cold_ttft.as_json(),
        "warm_ttft_s": s.warm_ttft.as_json(),
        "warm_steps_s": {k: v.as_json() for k, v in s.warm_steps.items()},
        "restore_over_load_file_paired": s.warm_over_load_file.as_json(),
        "warm_ttft_evicted": s.warm_evicted.as_json(),
        "warm_verified": s.warm_verified,
        "first_token_agrees": s.first_token_agrees,
        "save_s": {"prepare": s.save_prepare_s, "write": s.save_write_s},
        "blocks": s.blocks,
        "stored_bytes": s.stored_bytes,
        "raw_kv_bytes": s.raw_bytes,
        "compact": {
            "warm_ttft_s": s.compact_ttft.as_json(),
            "warm_steps_s": {k: v.as_json() for k, v in s.compact_steps.items()},
            "stored_bytes": s.compact_bytes,
            "restore_over_load_file_paired": s.compact_over_load_file.as_json(),
        },
        "get_data_s": s.get_data_s.as_json(),
        "floor_s": s.floor.read_set.as_json(),
        "set_data_s": s.floor.set_only.as_json(),
        "llama_file": {
            "save_s": f.save.as_json(),
            "load_s": f.load.as_json(),
            "ttft_s": f.ttft.as_json(),
            "ttft_evicted": f.ttft_cold.as_json(),
            "bytes": f.file_bytes,
        },
        "llama_disk_cache": {
            "eval_s": d.eval_s,
            "set_s": d.set.as_json(),
            "get_load_s": d.get_load.as_json(),
            "bytes": d.disk_bytes,
        },
        "ask_cold_cache": {
            "prompt_tokens": a.prompt_tokens,
            "ttft_cache_on_s": a.ttft_cache_on.as_json(),
            "ttft_cache_off_s": a.ttft_cache_off.as_json(),
            "return_cache_on_s": a.return_cache_on.as_json(),
            "return_cache_off_s": a.return_cache_off.as_json(),
            "background_write_s": a.background_write.as_json(),
        },
        "restore_memory": {
            "method": m.method,
            "rss_before_bytes": m.before_bytes,
            "peak_bytes": m.peak_bytes,
            "delta_bytes": m.delta_bytes,
        },
        "ratios": s.ratios,
        "encodings": [e.as_json() for e in s.encodings],
    }


def as_json(result: BenchResult, command: str) -> dict[str, object]:
    cfg = result.config
    lookup = result.lookup
    return {
        "command": command,
        "started": result.started,
        "seconds": result.seconds,
        "machine": result.machine,
        "model": result.model,
        "config": {
            "sizes": list(cfg.sizes),
            "cold_repeats": cfg.cold_repeats,
            "repeats": cfg.repeats,
            "lookup_blocks": cfg.lookup_blocks,
            "lookup_repeats": cfg.lookup_repeats,
            "decode_workers": cfg.workers,
        },
        "sizes": [_size_json(s) for s in result.sizes],
        "lookup": None
        if lookup is None
        else {
            "blocks": lookup.blocks,
            "chain_blocks": lookup.chain_blocks,
            "insert_s": lookup.insert_s,
            "request_tokens": lookup.request_tokens,
            "hit_reuse": lookup.hit_reuse,
            "hit_s": lookup.hit.as_json(),
            "miss_s": lookup.miss.as_json(),
        },
        "notes": result.notes,
    }


def write_json(result: BenchResult, path: Path, command: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(as_json(result, command), indent=2) + "\n", encoding="utf-8")
    return path


# -------------------------------------------------------------------- chart
def write_chart(result: BenchResult, path: Path) -> str | None:
    """Draw TTFT against prompt length (log y); returns why not, or None when written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return NO_MATPLOTLIB
    sizes = result.sizes
    xs = [s.tokens for s in sizes]
    series = [
        ("cold: prefill + first token", [s.cold_ttft for s in sizes], "o-"),
        ("localkv warm: verified restore + first token", [s.warm_ttft for s in sizes], "s-"),
        ("llama.cpp state file: load N-1 + decode 1", [s.llama_file.ttft for s in sizes], "^-"),
        ("floor: read raw state + set_data", [s.floor.read_set for s in sizes], "x:"),
    ]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, stats, style in series:
        med = [st.median for st in stats]
        below = [st.median - st.min for st in stats]
        above = [st.max - st.median for st in stats]
        ax.errorbar(xs, med, yerr=[below, above], fmt=style, label=label, capsize=3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s, log)")
    ax.set_title(f"{result.model.get('name')} — {result.machine.get('cpu')}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return None
