"""``localkv bench`` output: JSON, a terminal table, a markdown page and a PNG chart.

Every figure comes from one ``BenchResult``; the table, the markdown page and
the JSON show the same numbers. The chart needs matplotlib (``pip install
'localkv[bench]'``); without it ``write_chart`` says so and writes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from rich.table import Table

from localkv.bench import RESTORE, STEPS, BenchResult, SizeResult
from localkv.benchbaselines import ColdStat, Stat
from localkv.benchcodecs import ENCODINGS, EncodingResult

__all__ = [
    "CHART_NAME",
    "RESULTS_NAME",
    "as_json",
    "markdown",
    "rich_table",
    "rows",
    "write_chart",
    "write_json",
]

RESULTS_NAME = "results.json"
CHART_NAME = "ttft.png"
NO_MATPLOTLIB = "matplotlib is not installed: no chart (pip install 'localkv[bench]')"

Row = tuple[str, list[str]]


# --------------------------------------------------------------- formatting
_TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))


def _unit(seconds: float) -> tuple[float, str]:
    for scale, name in _TIME_UNITS:
        if seconds >= scale:
            return scale, name
    return _TIME_UNITS[-1]


def fmt_s(seconds: float) -> str:
    scale, name = _unit(seconds)
    return f"{seconds / scale:.3g} {name}"


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def fmt_stat(stat: Stat) -> str:
    """``median (min-max)`` in the median's unit; just the median for one measurement."""
    if stat.n == 1:
        return fmt_s(stat.median)
    scale, name = _unit(stat.median)
    return f"{_num(stat.median / scale)} {name} ({_num(stat.min / scale)}-{_num(stat.max / scale)})"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_ratio(x: float) -> str:
    return f"{x:.3g}x"


# --------------------------------------------------------------------- JSON
def _size_json(s: SizeResult) -> dict[str, object]:
    f, d, a, m = s.llama_file, s.disk_cache, s.ask, s.restore_memory
    return {
        "tokens": s.tokens,
        "cold_ttft_s": s.cold_ttft.as_json(),
        "warm_ttft_s": s.warm_ttft.as_json(),
        "warm_steps_s": {k: v.as_json() for k, v in s.warm_steps.items()},
        "warm_ttft_evicted": s.warm_evicted.as_json(),
        "warm_verified": s.warm_verified,
        "first_token_agrees": s.first_token_agrees,
        "save_s": {"prepare": s.save_prepare_s, "write": s.save_write_s},
        "blocks": s.blocks,
        "stored_bytes": s.stored_bytes,
        "raw_kv_bytes": s.raw_bytes,
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


# -------------------------------------------------------------------- table
Cell = Callable[[SizeResult], str]


def _step(name: str) -> Cell:
    return lambda s: fmt_stat(s.warm_steps[name])


def _ratio(name: str) -> Cell:
    return lambda s: fmt_ratio(s.ratios[name])


def _save(s: SizeResult) -> str:
    return f"{fmt_s(s.save_prepare_s)} + {fmt_s(s.save_write_s)}"


def _ask_return(s: SizeResult) -> str:
    return f"{fmt_s(s.ask.return_cache_on.median)} / {fmt_s(s.ask.return_cache_off.median)}"


def _peak(s: SizeResult) -> str:
    m = s.restore_memory
    return f"{fmt_bytes(m.peak_bytes)} (+{fmt_bytes(m.delta_bytes)})"


def fmt_encoding(e: EncodingResult) -> str:
    """``ratio | decode median (min-max)``; no time for a decoder that was not verified."""
    decode = fmt_stat(e.decode) if e.verified and e.decode is not None else "NOT VERIFIED"
    return f"{e.ratio:.3f} | {decode}"


NOT_DROPPED = "page cache not dropped"
NOT_VERIFIED_COLD = "page cache drop not verified"


def fmt_cold(c: ColdStat) -> str:
    """The time from storage, or why there is none: never a page-cache time as a cold one."""
    if c.dropped:
        return fmt_stat(c.time)
    if c.evicted and c.read_bytes is None:  # advice given, no /proc/self/io to check it
        return NOT_VERIFIED_COLD
    return NOT_DROPPED


def fmt_read(c: ColdStat) -> str:
    """Median bytes a run read from storage (``?`` where unknown)."""
    return "?" if c.read_bytes is None else fmt_bytes(c.read_bytes.median)


def fmt_encoding_cold(e: EncodingResult) -> str:
    """``decode from disk | read from storage``; no time unless verified and really cold."""
    c = e.decode_cold
    if not e.verified or c is None:
        return "NOT VERIFIED"
    return f"{fmt_cold(c)} | {fmt_read(c)}"


def _encoding(name: str, fmt: Callable[[EncodingResult], str] = fmt_encoding) -> Cell:
    def cell(s: SizeResult) -> str:
        found = [e for e in s.encodings if e.name == name]
        return fmt(found[0]) if found else "-"

    return cell


def _cold_reads(s: SizeResult) -> str:
    return f"{fmt_read(s.warm_evicted)} / {fmt_read(s.llama_file.ttft_cold)}"


def _cold_ratio(s: SizeResult) -> str:
    ours, theirs = s.warm_evicted, s.llama_file.ttft_cold
    if not (ours.dropped and theirs.dropped):
        return "-"
    return fmt_ratio(ours.time.median / theirs.time.median)


def _escape(cell: str) -> str:
    """A markdown table cell: a literal ``|`` would start a new column."""
    return cell.replace("|", "\\|")


CELLS: list[tuple[str, Cell]] = [
    ("cold TTFT (prefill + first token)", lambda s: fmt_stat(s.cold_ttft)),
    ("warm TTFT (verified restore + first token)", lambda s: fmt_stat(s.warm_ttft)),
    *[(f"  warm: {k}", _step(k)) for k in STEPS],
    ("  warm: restore without the probe (lookup + read + load)", _step(RESTORE)),
    ("warm TTFT, block files not in page cache", lambda s: fmt_cold(s.warm_evicted)),
    ("llama.cpp-file TTFT (load N-1, decode 1)", lambda s: fmt_stat(s.llama_file.ttft)),
    (
        "llama.cpp-file TTFT, file not in page cache",
        lambda s: fmt_cold(s.llama_file.ttft_cold),
    ),
    ("read from storage per cold restore (ours / llama.cpp)", _cold_reads),
    ("llama.cpp save_file", lambda s: fmt_stat(s.llama_file.save)),
    ("llama.cpp load_file", lambda s: fmt_stat(s.llama_file.load)),
    ("LlamaDiskCache set", lambda s: fmt_stat(s.disk_cache.set)),
    ("LlamaDiskCache get + load_state", lambda s: fmt_stat(s.disk_cache.get_load)),
    ("floor (read raw state + set_data)", lambda s: fmt_stat(s.floor.read_set)),
    ("llama_state_seq_get_data", lambda s: fmt_stat(s.get_data_s)),
    ("llama_state_seq_set_data", lambda s: fmt_stat(s.floor.set_only)),
    ("cold / warm", _ratio("cold_over_warm")),
    ("warm / llama.cpp-file TTFT", _ratio("warm_over_llama_file_ttft")),
    ("warm / llama.cpp-file TTFT, not in page cache", _cold_ratio),
    ("warm / floor", _ratio("warm_over_floor")),
    ("restore without the probe / llama.cpp load_file", _ratio("restore_over_load_file")),
    ("restore without the probe / floor", _ratio("restore_over_floor")),
    ("bytes on disk", lambda s: fmt_bytes(s.stored_bytes)),
    ("raw KV bytes", lambda s: fmt_bytes(s.raw_bytes)),
    ("  on disk / raw", lambda s: f"{s.ratios['stored_over_raw']:.3f}"),
    *[(f"encoding {e.name}: on disk / raw | decode", _encoding(e.name)) for e in ENCODINGS],
    *[
        (
            f"encoding {e.name}: decode from disk | read from storage",
            _encoding(e.name, fmt_encoding_cold),
        )
        for e in ENCODINGS
    ],
    ("llama.cpp file bytes", lambda s: fmt_bytes(s.llama_file.file_bytes)),
    ("LlamaDiskCache bytes", lambda s: fmt_bytes(s.disk_cache.disk_bytes)),
    ("save: prepare + write", _save),
    ("ask TTFT, cold cache, cache on", lambda s: fmt_stat(s.ask.ttft_cache_on)),
    ("ask TTFT, cold cache, cache off", lambda s: fmt_stat(s.ask.ttft_cache_off)),
    ("ask returns, cache on / off", _ask_return),
    ("ask background block write", lambda s: fmt_stat(s.ask.background_write)),
    ("peak RSS in restore (+ over before)", _peak),
    ("verified", lambda s: "yes" if s.warm_verified else "NO"),
    ("same first token as cold", lambda s: "yes" if s.first_token_agrees else "NO"),
]


def rows(result: BenchResult) -> list[Row]:
    """Labelled rows, one cell per prompt length (medians with min-max)."""
    return [(label, [fn(s) for s in result.sizes]) for label, fn in CELLS]


def rich_table(result: BenchResult) -> Table:
    table = Table(title=f"localkv bench — {result.model.get('name')}", show_lines=False)
    table.add_column("prompt tokens", style="bold", overflow="fold")
    for s in result.sizes:
        table.add_column(f"{s.tokens:,}", justify="right")
    for label, cells in rows(result):
        table.add_row(label, *cells)
    return table


def lookup_line(result: BenchResult) -> str | None:
    lk = result.lookup
    if lk is None:
        return None
    return (
        f"Longest-prefix lookup with {lk.blocks:,} blocks indexed (chains of "
        f"{lk.chain_blocks}), request of {lk.request_tokens:,} tokens: hit "
        f"(reuses {lk.hit_reuse:,}) {fmt_stat(lk.hit)}, miss {fmt_stat(lk.miss)}; "
        f"indexing took {fmt_s(lk.insert_s)} ({fmt_s(lk.insert_s / max(1, lk.blocks))} a block)."
    )


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


# ----------------------------------------------------------------- markdown
def markdown(result: BenchResult, command: str, chart: str | None = None) -> str:
    """The whole ``docs/BENCHMARKS.md`` page; ``chart`` is a relative image path."""
    m, mo = result.machine, result.model
    head = ["prompt tokens", *[f"{s.tokens:,}" for s in result.sizes]]
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `localkv bench --write-docs`; do not edit by hand. -->",
        "",
        f"Generated {result.started} in {result.seconds:.0f} s by:",
        "",
        "```",
        command,
        "```",
        "",
        "## Machine",
        "",
        f"- CPU: {m.get('cpu')}, {m.get('cores')} cores",
        f"- memory: {fmt_bytes(float(str(m.get('memory_bytes', 0))))}",
        f"- GPU: {m.get('gpu')}",
        f"- {m.get('os')}, Python {m.get('python')}, llama-cpp-python {m.get('llama_cpp_python')}",
        "",
        "## Model and settings",
        "",
        f"- {mo.get('name')} ({mo.get('description')}), "
        f"{fmt_bytes(float(str(mo.get('file_bytes', 0))))}",
        f"- KV cache {mo.get('type_k')}/{mo.get('type_v')}, flash attention "
        f"{mo.get('flash_attn')}, n_ctx {mo.get('n_ctx')}, n_batch {mo.get('n_batch')}, "
        f"{mo.get('n_threads')} thread(s), blocks of {mo.get('block_size')} tokens",
        f"- repeats: {result.config.cold_repeats} for full prefills, "
        f"{result.config.repeats} for everything else; cells are median (min-max); "
        f"block encodings decoded on {result.config.workers} thread(s)",
        "",
        "## Results",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *[
            "| " + " | ".join(_escape(c) for c in [label.strip(), *cells]) + " |"
            for label, cells in rows(result)
        ],
        "",
    ]
    if chart:
        lines += [f"![time to first token against prompt length]({chart})", ""]
    lookup = lookup_line(result)
    if lookup:
        lines += ["## Lookup at scale", "", lookup, ""]
    lines += ["## How each figure is measured", "", *METHOD, ""]
    if result.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in result.notes], ""]
    return "\n".join(lines)


METHOD = [
    "- The prompt is the opening of *Alice's Adventures in Wonderland* (public domain), "
    "repeated under chapter numbers, tokenized and cut to exactly N tokens. All caches "
    "live in a fresh temporary directory.",
    "- **cold TTFT**: empty sequence, block-aligned prefill of N tokens "
    "(`ModelSession.prefill`), argmax of the last logits.",
    "- **warm TTFT**: the N tokens saved as blocks (`PrefixCache.prepare` + `write`), the "
    "sequence emptied, then `PrefixCache.restore` (lookup; read: block headers checked "
    "against the index, K/V rows read with `preadv` straight into their places in the "
    "state buffer, xxh3-128 of every file; load: `llama_state_seq_set_data` of N-1 "
    "tokens; probe: the last token decoded alone, its logits compared bit for bit with "
    "the stored probe) and argmax. The probe decode yields the first token's logits, so "
    "it is the decode llama.cpp's own TTFT pays too. **restore without the probe** is "
    "lookup + read + load: the state in place, as `load_file` leaves it.",
    "- **not in page cache** / **from disk**: the same measurement, run after the page-cache "
    "runs, with its files dropped from the page cache before each run, without root: each "
    "file is opened read-only, fsynced (a dirty page is not dropped) and given "
    "`posix_fadvise(POSIX_FADV_DONTNEED)` (`localkv.benchdisk`). Evicted are: every block "
    "file of the saved chain (warm TTFT), the N-1-token state file (llama.cpp-file TTFT), "
    "the encoding's block files (encoding rows). The eviction and the fsync are not timed. "
    "The advice can be ignored, so each run is checked: `read_bytes` of `/proc/self/io` "
    "(bytes this process fetched from storage, all threads) is read before and after the "
    "timed part, and the **read from storage** figures are that difference, median over "
    "the runs. A time is shown only if every run read at least half its files' bytes from "
    "storage; otherwise the cell says *page cache not dropped* (or *page cache drop not "
    "verified* without `/proc/self/io`). On a virtual machine the storage is the virtual "
    "disk, which the host may cache in turn.",
    "- **llama.cpp-file TTFT**: `llama_state_seq_load_file` of a file holding N-1 tokens, "
    "then the last token decoded alone and argmax. save_file/load_file rows use N tokens. "
    "**warm / llama.cpp-file TTFT, not in page cache** is the ratio of the two medians from "
    "storage, shown when both were verified cold.",
    "- **LlamaDiskCache**: llama-cpp-python's high-level `Llama` evaluates the same tokens; "
    "`cache[tokens] = llm.save_state()`, then `llm.load_state(cache[tokens])`. The get "
    "removes the entry, so each get follows its own set.",
    "- **floor**: the raw `llama_state_seq_get_data` bytes read from a file in the page "
    "cache into a buffer allocated and touched beforehand, then `llama_state_seq_set_data`: "
    "no checks, no decode, no fresh memory. The set_data row is that call alone. "
    "`llama_state_seq_load_file` reads straight into the KV tensors, so it can beat this.",
    "- **bytes on disk**: the saved chain's block files (their format: "
    "`storage/blockfile.py`); raw KV is the size of llama.cpp's sequence state for the N "
    "tokens.",
    "- **encoding rows** (`localkv.benchcodecs`): the N tokens' state, captured once after "
    "the cold prefill, cut into blocks and written as one file per block three ways: `raw` "
    "(the K and V rows as they are), `zstd-1` (one zstd level-1 frame per tensor) and "
    "`hi-plane zstd-1` (each f16 tensor's low byte plane as is, its high byte plane, sign "
    "and exponent, zstd level 1). Each cell is bytes in the block files over raw KV bytes "
    "(the K and V rows, no state header), then the time to decode every block into one "
    "buffer laid out like `set_data`'s rows, allocated and touched beforehand, blocks in "
    "parallel on a thread pool, files in the page cache: raw by `preadv` straight into "
    "place, the others read, decompressed and interleaved. The **decode from disk** rows "
    "time the same decode with the encoding's block files evicted before each run, then "
    "the bytes each run read from storage (fewer for the compressed encodings: that is "
    "what compression could save). Every decode hashes the bytes it "
    "read (xxh3-128) against the digest taken when the file was written; the first decode "
    "of each encoding and every decode from disk is compared with the original bytes, and "
    "one that differs shows NOT VERIFIED instead of a time. `set_data` itself is not "
    "included (see its row).",
    "- **ask**: `Runtime.ask` about a document of about N tokens on an empty cache, with the "
    "cache on and with `use_cache=False`. With the cache on, new blocks are captured after "
    "the answer and written by a background thread, so they do not delay the first token.",
    "- **get_data / set_data**: llama.cpp's state calls alone, on a buffer allocated beforehand.",
    "- **peak RSS**: the resident set size high-water mark during one restore, and how far "
    "it rose above the size before. Memory the allocator kept from earlier steps is reused "
    "without raising it, so the rise is a lower bound on what a restore allocates.",
]
