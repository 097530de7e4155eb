"""``localkv bench`` output: the JSON, the markdown page and the PNG chart, from one result.

Every figure comes from one ``BenchResult``; the terminal table, the markdown
page and the JSON show the same numbers. The table and each figure's text are
``table``'s (re-exported here); the page also says how each figure is taken
(``METHOD``). The chart needs matplotlib (``pip install 'localkv[bench]'``),
imported only when ``write_chart`` draws; without it ``write_chart`` says so
and writes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from localkv.bench.results import BenchResult, SizeResult
from localkv.bench.stats import Stat
from localkv.bench.table import (
    CELLS,
    fmt_bytes,
    fmt_cold,
    fmt_encoding,
    fmt_encoding_cold,
    fmt_stat,
    lookup_line,
    rich_table,
    rows,
)

# the table and the figures' text are imported from here too
__all__ = [
    "CELLS",
    "CHART_NAME",
    "METHOD",
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
def _warm_json(ttft: Stat, steps: dict[str, Stat], paired: Stat) -> dict[str, Any]:
    """A warm restore's figures: its first token, its steps, each over its load_file."""
    return {
        "warm_ttft_s": ttft.as_json(),
        "warm_steps_s": {k: v.as_json() for k, v in steps.items()},
        "restore_over_load_file_paired": paired.as_json(),
    }


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
        "partial_bytes": s.partial_bytes,
        "raw_kv_bytes": s.raw_bytes,
        "compact": {
            **_warm_json(s.compact_ttft, s.compact_steps, s.compact_over_load_file),
            "stored_bytes": s.compact_bytes,
        },
        "packed": _warm_json(s.packed_ttft, s.packed_steps, s.packed_over_load_file)
        if s.packed_ttft and s.packed_steps and s.packed_over_load_file
        else None,
        "get_data_s": s.get_data_s.as_json(),
        "floor_s": s.floor.read_set.as_json(),
        "set_data_s": s.floor.set_only.as_json(),
        "read_hash_s": s.floor.read_hash.as_json(),
        "read_hash_placed_s": s.floor.read_hash_placed.as_json(),
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


# ----------------------------------------------------------------- markdown
def _escape(cell: str) -> str:
    """A markdown table cell: a literal ``|`` would start a new column."""
    return cell.replace("|", "\\|")


def markdown(result: BenchResult, command: str, chart: str | None = None) -> str:
    """The whole ``docs/performance/benchmarks.md`` page; ``chart`` is a relative image path."""
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
        f"- compact block decoder: {m.get('compact_decoder')}",
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
    "lookup + read + load: the state in place, as `load_file` leaves it. Its ratio to "
    "`load_file` comes twice: the ratio of the two medians, and, run by run, the restore "
    "over a `load_file` of the same N tokens timed just before it in the same loop (median, "
    "min to max), so that both sides of each ratio meet the same machine state.",
    "- **not in page cache** / **from disk**: the same measurement, run after the page-cache "
    "runs, with its files dropped from the page cache before each run, without root: each "
    "file is opened read-only, fsynced (a dirty page is not dropped) and given "
    "`posix_fadvise(POSIX_FADV_DONTNEED)` (`localkv.bench.disk`). Evicted are: every block "
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
    "`llama_state_seq_load_file` reads straight into the KV tensors, so it can beat this. "
    "**read + hash floor**: the saved chain's block files, the bytes a restore reads, read "
    "from the page cache into a ready buffer and hashed with the store's xxh3-128, one "
    "file after another: reading and checking them, with nothing placed or loaded: the "
    "buffer stays in the CPU's cache. **each file into its own place**: the same into one "
    "buffer as large as all the files, touched beforehand, a place of its own for each, as "
    "a restore must put every byte where `llama_state_seq_set_data`'s one contiguous "
    "buffer holds it: every byte is written out to memory. With the set_data row after "
    "it, that is the floor of a restore that reads into the state buffer once, checks "
    "every byte and loads once, the ratio's denominator.",
    "- **bytes on disk**: the saved chain's block files (their format: "
    "`storage/blockfile.py`); raw KV is the size of llama.cpp's sequence state for the N "
    "tokens.",
    "- **compact blocks**: the same blocks written by a second store in the compact format "
    "(`--compact-cache`; `storage/planes.py`, `storage/q6.py`: each f16 tensor as its low "
    "byte plane, stored as is, and its high bytes as 6-bit indices into a table of the "
    "tensor's 63 most frequent ones, the others escaped, in one safetensors file), then the "
    "warm restore of **warm TTFT** from them, files in the page cache. Its read step reads "
    "each file whole, checks its xxh3-128 and decodes the two planes into the state buffer "
    "(compiled, AVX2 where the CPU has it).",
    "- **packed state**: the warm restore of **warm TTFT** through the chain's packed state "
    "(`localkv/cache/restore/packed.py`, `storage/packed.py`): llama.cpp's state stream in "
    "one file, written from the blocks by one restore from them before these runs; its "
    "read step maps the file, its load step hands the mapping to "
    "`llama_state_seq_set_data` while a reader thread checks the file's xxh3-128 beside "
    "it (the state is used once both are done), and the probe then decodes the chain's "
    "last token as a restore from the blocks does. The rows above it restore from the "
    "blocks.",
    "- **encoding rows** (`localkv.bench.codecs`): the N tokens' state, captured once after "
    "the cold prefill, cut into blocks and written as one file per block four ways: `raw` "
    "(the K and V rows as they are), `zstd-1` (one zstd level-1 frame per tensor), "
    "`hi-plane zstd-1` (each f16 tensor's low byte plane as is, its high byte plane, sign "
    "and exponent, zstd level 1) and `hi-plane q6` (the high bytes in the compact blocks' "
    "6-bit code instead). Each cell is bytes in the block files over raw KV bytes "
    "(the K and V rows, no state header), then the time to decode every block into one "
    "buffer laid out like `set_data`'s rows, allocated and touched beforehand, blocks in "
    "parallel on a thread pool, files in the page cache: raw by `preadv` straight into "
    "place, the others read, decoded and interleaved. The **decode from disk** rows "
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
    "- **the first token a person sees**: a fresh `localkv ask` process on a warm cache, "
    "from the process's start to the answer's first text, per OpenMP wait setting, idle "
    "and under a fixed load of CPU-bound processes, with the load average of every run: "
    "`benchmarks/firsttoken.py --write-docs docs/performance/firsttoken.md` (one command), in "
    "[firsttoken.md](firsttoken.md).",
    "- **the warm first token in every face**: a fresh `ask`, `Runtime.ask`, `serve` after "
    "a restart and a live repeat, idle and with two CPU-bound processes, each beside "
    "llama-cpp-python's own path (its state file, `llama_cpp.server` with its disk cache), "
    "medians of 5, with how many of localkv's modules ran from compiled bytecode: "
    "`benchmarks/faces.py --peer-python PY --write-docs docs/performance/faces.md`, in "
    "[faces.md](faces.md).",
    "- **get_data / set_data**: llama.cpp's state calls alone, on a buffer allocated beforehand.",
    "- **peak RSS**: the resident set size high-water mark during one restore, and how far "
    "it rose above the size before. Memory the allocator kept from earlier steps is reused "
    "without raising it, so the rise is a lower bound on what a restore allocates.",
]


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
