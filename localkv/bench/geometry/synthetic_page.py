"""The synthetic restore's figures: ratios, and their own section of the geometry page and JSON.

``write(out, run)`` puts ``run`` (``synthetic.measure_synthetic``'s figures with
the command, machine and load) under the key ``synthetic`` of
``out/geometry.json`` and between this section's markers in ``out/geometry.md``
(at the end when they are not there yet), leaving the rest of both files as
they are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["BEGIN", "END", "TARGET", "derived", "section", "write"]

BEGIN = "<!-- synthetic restore: written by benchmarks/geometry.py --synthetic -->"
END = "<!-- end of synthetic restore -->"
TARGET = 0.6  # of each floor


def derived(f: Mapping[str, Any]) -> dict[str, float]:
    """Throughputs (GB/s) and each restore's ratio to its floor (floor seconds over its)."""
    needed, size = float(f["needed"]), float(f["file_bytes"])
    out: dict[str, float] = {
        "memcpy_gb_s": needed / f["memcpy_s"] / 1e9,
        "read_dropped_gb_s": size / f["read_dropped_s"] / 1e9,
        "read_warm_gb_s": size / f["read_warm_s"] / 1e9,
    }
    for case in ("first", "warm", "dropped"):
        out[f"{case}_gb_s"] = needed / f[case]["restore_s"] / 1e9
        out[f"{case}_with_probe_gb_s"] = needed / f[case]["with_probe_s"] / 1e9
    load = f.get("llama_load") or {}
    if load:
        out["llama_load_over_memcpy"] = f["memcpy_s"] / load["mapped_s"]
        out["warm_over_llama_load"] = f["warm"]["restore_s"] / load["new_s"]
        out["own_pace_over_memcpy"] = f["memcpy_s"] / load["own_pace_digest_s"]
    for case, floor in (("first", "memcpy_s"), ("warm", "memcpy_s"), ("dropped", "read_dropped_s")):
        out[f"{case}_over_floor"] = f[floor] / f[case]["restore_s"]
        out[f"{case}_with_probe_over_floor"] = f[floor] / f[case]["with_probe_s"]
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f} ms"


def _row(label: str, name: str, f: Mapping[str, Any], d: Mapping[str, float]) -> str:
    steps = f[name]
    parts = ", ".join(
        f"{k} {_ms(v)}" for k, v in steps.items() if k not in ("restore_s", "with_probe_s")
    )
    floor = "memcpy" if name != "dropped" else "sequential read, dropped"
    met = "met" if d[f"{name}_over_floor"] >= TARGET else "not met"
    return (
        f"| {label} | {_ms(steps['restore_s'])} ({d[f'{name}_gb_s']:.2f} GB/s) "
        f"| {_ms(steps['with_probe_s'])} ({d[f'{name}_with_probe_gb_s']:.2f} GB/s) | {parts} "
        f"| {d[f'{name}_over_floor']:.2f} / {d[f'{name}_with_probe_over_floor']:.2f} of {floor} "
        f"({met}) |"
    )


def _table(r: Mapping[str, Any]) -> list[str]:
    f, d = r["figures"], r["derived"]
    return [
        f"**{r['label']}, {f['tokens']:,} tokens**: state {f['needed'] / 2**30:.2f} GiB "
        f"({f['needed']:,} bytes), store {f['disk']:,} bytes; {f['reused']:,} tokens "
        f"restored, {'every restore verified' if f['verified'] else 'NOT VERIFIED'}; "
        f"chain made in {f['build_s']:.1f} s, saved in {f['save_s']:.1f} s; "
        f"{_threads(f)}load average before / after {r['load_before']} / {r['load_after']}.",
        "",
        "| restore | without the probe | with it | steps (median) | over its floor "
        "(without / with the probe) |",
        "|---|---|---|---|---|",
        _row("first in the process, warm (blocks)", "first", f, d),
        _row(f"warm, median of {r['repeats']}", "warm", f, d),
        _row(f"dropped, median of {r['repeats']}", "dropped", f, d),
        "",
        f"Floors: memcpy of the state's bytes {_ms(f['memcpy_s'])} "
        f"({d['memcpy_gb_s']:.2f} GB/s); sequential read of the store's files, dropped "
        f"{_ms(f['read_dropped_s'])} ({d['read_dropped_gb_s']:.2f} GB/s), in the page cache "
        f"{_ms(f['read_warm_s'])} ({d['read_warm_gb_s']:.2f} GB/s). Dropping took "
        f"{f['dropped_from_page_cache'] / 2**30:.2f} GiB out of the page cache (`Cached`).",
        "",
        *_llama_load(f, d),
    ]


def _llama_load(f: Mapping[str, Any], d: Mapping[str, float]) -> list[str]:
    """Where a warm restore's time goes beside llama.cpp's own load of the same stream."""
    load = f.get("llama_load") or {}
    if not load:
        return []
    rest = f["warm"]["restore_s"] - load["new_s"]
    beside = f"{_ms(rest)} more" if rest >= 0 else f"{_ms(-rest)} less"
    return [
        f"llama.cpp's own load of the packed stream (`llama_state_seq_set_data` from the "
        f"mapped file, with no lookup or probe; medians): {_ms(load['new_s'])} from a new "
        f"mapping, as a restore maps the file (its pages mapped as the load reads them), "
        f"{_ms(load['mapped_s'])} from one whose pages are all mapped "
        f"({d['llama_load_over_memcpy']:.2f} of memcpy; the kernel mapped "
        f"{load['huge_page_bytes'] / load['packed_bytes']:.0%} of the file in huge pages); "
        f"from a new mapping with the "
        f"stream's xxh3-128 read beside it at its own pace, as a restore read its "
        f"checksum before, {_ms(load['own_pace_digest_s'])} "
        f"({d['own_pace_over_memcpy']:.2f} of memcpy: the two reads share the memory's "
        f"bandwidth). A restore reads the checksum at most a couple of MiB ahead of the "
        f"load instead (`storage/frontier.py`), so the load finds each byte in the "
        f"cache: the warm restore, its lookup too, takes "
        f"{d['warm_over_llama_load']:.2f}x the load alone from a new mapping: {beside}.",
        "",
    ]


def _threads(f: Mapping[str, Any]) -> str:
    """The restoring runtime's threads."""
    return f"restored with {f['threads']} decode threads and {f['readers']} reader threads; "


NOTES = (
    "The chain is synthetic (`localkv/bench/geometry/chain.py`): the request of N tokens "
    "of the bench text is put into llama.cpp in its canonical batches, but each batch of "
    "two or more tokens is loaded as a sequence state (`codec.assembly`, "
    "`ModelSession.load_state`) whose K and V rows are random f16 values (standard normal), "
    "not computed; each token the schedule decodes alone (every block's last, the "
    "request's last) is decoded by llama.cpp over those rows, so every block has its real "
    "probe. It is then saved by `Runtime.save_prefix` and restored by `Runtime.restore` "
    "as any prefill's chain. The values are random: a restore's time does not depend on "
    "them, and the probe verifies the same way.",
    "Restore: `RestoreResult.breakdown`, lookup + read + load (without the probe) and "
    "the probe decode; columns (V into llama.cpp's columns, on the reader threads, summed "
    "over them) is a part of read, shown apart; throughput is the restored state's bytes "
    "(`llama_state_seq_get_size`) over those seconds. A fresh `Runtime` on the store, "
    "with the thread count a user gets (fitted to the free cores; the store reads blocks "
    "on its reader threads, the next pieces while one loads, only where that is more than "
    "one: `localkv/cache/restore/pieces.py`), restores first with the files in the page "
    "cache and on the disk (the store, and later the packed state, are written to the "
    "disk, `os.sync`, before the restores that read them: a restore minutes after a "
    "save finds no writeback in flight), from the blocks, which packs the chain after "
    "it (`localkv/cache/restore/"
    "packed.py`: llama.cpp's state stream in one file; its budget is set to hold it, "
    "four times the state at least, as a user's `LOCALKV_BUDGET` may); the repeats then "
    "restore through the packed state where it was written (a packed restore has no "
    "columns step: its read maps the file, its load hands the mapping to llama.cpp while "
    "a reader thread checks the file's checksum a little ahead of it, and it decodes its "
    "probe; the "
    "store's bytes count the packed state too); then, each "
    "repeat, every file of the store is written back and dropped from the page cache "
    "(`posix_fadvise(DONTNEED)`) and restored again. A restore from the blocks decodes "
    "its probe only the first time in a process (`localkv/cache/restore/probed.py`); "
    "a packed one always does.",
    f"Floors, with the runtime closed: a numpy copy of as many bytes as the state between "
    f"two ready buffers; the store's block files (not the packed state) read one after "
    f"another in 64 MiB chunks into one ready buffer, after the same drop, and again from "
    f"the page cache. Targets: "
    f"warm restore >= {TARGET:.0%} of memcpy, dropped >= {TARGET:.0%} of the dropped read.",
)


def section(run: Mapping[str, Any]) -> str:
    """This section of the page, markers included."""
    lines = [BEGIN, "", "## Restore of a long prefix, from a synthetic chain", ""]
    lines += [f"Command: `{run['command']}` (started {run['started']}, {run['seconds']} s).", ""]
    m = run["machine"]
    lines += [f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB.", ""]
    for r in run["results"]:
        lines += _table(r)
    lines += [f"- {n}" for n in NOTES]
    return "\n".join([*lines, "", END])


def _spliced(page: str, text: str) -> str:
    if BEGIN in page and END in page:
        head, rest = page.split(BEGIN, 1)
        return head + text + rest.split(END, 1)[1]
    return page.rstrip("\n") + "\n\n" + text + "\n"


def write(out: Path, run: Mapping[str, Any]) -> None:
    """``run`` into ``out/geometry.json`` (key ``synthetic``) and its section of ``geometry.md``."""
    out.mkdir(parents=True, exist_ok=True)
    data_path, page_path = out / "geometry.json", out / "geometry.md"
    data = json.loads(data_path.read_text()) if data_path.exists() else {}
    data["synthetic"] = run
    data_path.write_text(json.dumps(data, indent=2) + "\n")
    page = page_path.read_text() if page_path.exists() else "# Cache at real model geometry\n"
    page_path.write_text(_spliced(page, section(run)))
