"""The page's figures from a run's JSON: each a pair of medians and their ratio, and the targets.

``Figure`` is one row: what is compared, localkv's runs and the other server's, how
to print them, and the ratio of the medians localkv / other. ``length_figures`` and
``alternate_figures`` read them from the runs as the bench wrote them; ``targets``
says, for each ratio the project holds itself to, the bound and whether the run met it.
``restart_parts`` splits localkv's first token after a restart into the parts its
server reports, beside llama-server's slot restore call and its request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from localkv.bench.stats import Stat

__all__ = [
    "PART_LABELS",
    "Figure",
    "Part",
    "Target",
    "alternate_figures",
    "length_figures",
    "restart_parts",
    "targets",
]

Runs = Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Figure:
    """localkv's runs against another server's on one figure."""

    label: str
    other: str  # the other server, as the page names it
    unit: str  # "s" (lower is better), "tok/s" (higher is better), "B/token" (lower)
    localkv: Stat
    peer: Stat

    @property
    def ratio(self) -> float | None:
        """localkv's median over the other's (None: the other's median is zero)."""
        return self.localkv.median / self.peer.median if self.peer.median else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """A ratio the project holds itself to, and whether this run met it."""

    what: str
    ratio: float | None
    bound: float
    higher_is_better: bool = False

    @property
    def met(self) -> bool:
        if self.ratio is None:
            return False
        return self.ratio >= self.bound if self.higher_is_better else self.ratio <= self.bound


@dataclass(frozen=True, slots=True, kw_only=True)
class Part:
    """A part of the first token after a restart: localkv's runs, llama-server's (n 0: none)."""

    label: str
    localkv: Stat
    peer: Stat


# the parts of localkv's first token after a restart (``restart.PARTS``), as the page names them
PART_LABELS = {
    "prompt": "prompt build (render, tokenize)",
    "lookup": "restore: lookup",
    "read": "restore: read, columns excluded",
    "columns": "restore: V into columns",
    "load": "restore: load into llama.cpp",
    "probe": "restore: probe",
    "rest": "the rest of the first token",
}


def _of(values: Sequence[float]) -> Stat:
    return Stat.of(values) if values else Stat(median=0.0, min=0.0, max=0.0, n=0)


def _stat(runs: Runs, key: str) -> Stat:
    return _of([float(r[key]) for r in runs if r.get(key) is not None])


def _one(value: float) -> Stat:
    return Stat(median=value, min=value, max=value, n=1)


def _figure(label: str, other: str, unit: str, mine: Stat, theirs: Stat) -> Figure:
    return Figure(label=label, other=other, unit=unit, localkv=mine, peer=theirs)


def length_figures(length: Mapping[str, Any]) -> list[Figure]:
    """The cold, restart and bytes-on-disk rows of one length."""
    cold, restart = length["cold"], length["restart"]
    lk, ls = cold["localkv"], cold["llama-server"]
    back, slot = restart["runs"]["localkv"], restart["runs"]["llama-server slot"]
    disk = restart["disk"]
    per_token = _one(disk["block_bytes"] / max(1, disk["localkv_tokens"]))
    # with the packed state (older runs have none)
    held = _one(
        (disk["block_bytes"] + disk.get("packed_bytes", 0)) / max(1, disk["localkv_tokens"])
    )
    slot_token = _one(disk["slot_file_bytes"] / max(1, disk["slot_tokens"]))
    return [
        _figure("cold: first token", "llama-server", "s", _stat(lk, "ttft_s"), _stat(ls, "ttft_s")),
        _figure(
            "cold: prefill, the server's own time",
            "llama-server",
            "s",
            _stat(lk, "server_prefill_s"),
            _stat(ls, "server_prefill_s"),
        ),
        _figure("cold: server CPU", "llama-server", "s", _stat(lk, "cpu_s"), _stat(ls, "cpu_s")),
        _figure(
            "cold: decode",
            "llama-server",
            "tok/s",
            _stat(lk, "decode_tok_s"),
            _stat(ls, "decode_tok_s"),
        ),
        _figure(
            "restart: first token",
            "slot restore + request",
            "s",
            _stat(back, "ttft_s"),
            _stat(slot, "restore_and_ttft_s"),
        ),
        _figure(
            "restart: first token",
            "slot request alone",
            "s",
            _stat(back, "ttft_s"),
            _stat(slot, "ttft_s"),
        ),
        _figure(
            "restart: first token",
            "--cache-ram (re-prefill)",
            "s",
            _stat(back, "ttft_s"),
            _stat(ls, "ttft_s"),
        ),
        _figure("bytes on disk per token", "slot file", "B/token", per_token, slot_token),
        _figure(
            "bytes on disk per token, packed state too", "slot file", "B/token", held, slot_token
        ),
    ]


def restart_parts(length: Mapping[str, Any]) -> list[Part]:
    """localkv's restart, part by part (``parts_s``), its whole restore (``restore_ms``) and
    its first token, beside llama-server's slot restore call, its request alone and both."""
    back, slot = (
        length["restart"]["runs"]["localkv"],
        length["restart"]["runs"]["llama-server slot"],
    )
    split = [r["parts_s"] for r in back if r.get("parts_s")]
    none = _of([])
    rows = [
        Part(label=label, localkv=_of([p[name] for p in split]), peer=none)
        for name, label in PART_LABELS.items()
        if name != "rest"
    ]
    restore = [float(r["server"]["restore_ms"]) / 1000 for r in back if r.get("parts_s")]
    return [
        *rows,
        Part(label="restore, all its steps", localkv=_of(restore), peer=_stat(slot, "restore_s")),
        Part(
            label=PART_LABELS["rest"],
            localkv=_of([p["rest"] for p in split]),
            peer=_stat(slot, "ttft_s"),
        ),
        Part(
            label="first token, as the client saw it",
            localkv=_of([float(r["ttft_s"]) for r in back if r.get("parts_s")]),
            peer=_stat(slot, "restore_and_ttft_s"),
        ),
    ]


def alternate_figures(runs: Mapping[str, Runs]) -> list[Figure]:
    """localkv's turns against each llama-server's."""
    mine = _stat(runs["localkv"], "ttft_s")
    return [
        _figure("two documents in turn: first token", other, "s", mine, _stat(theirs, "ttft_s"))
        for other, theirs in runs.items()
        if other != "localkv"
    ]


def targets(data: Mapping[str, Any]) -> list[Target]:
    """The issue's ratios: restart against the slot restore and two documents against the RAM
    cache within 1.15x, cold prefill CPU and decode within 5%."""
    out = []
    for length in data["lengths"]:
        n = f"{length['tokens']:,}"
        by = {(f.label, f.other): f for f in length_figures(length)}
        restart = by[("restart: first token", "slot restore + request")]
        cpu = by[("cold: server CPU", "llama-server")]
        decode = by[("cold: decode", "llama-server")]
        out += [
            Target(
                what=f"{n}: restart first token / slot restore", ratio=restart.ratio, bound=1.15
            ),
            Target(what=f"{n}: cold prefill CPU / llama-server's", ratio=cpu.ratio, bound=1.05),
            Target(
                what=f"{n}: decode rate / llama-server's",
                ratio=decode.ratio,
                bound=0.95,
                higher_is_better=True,
            ),
        ]
    if data.get("alternate"):
        for f in alternate_figures(data["alternate"]["runs"]):
            if f.other == "llama-server --cache-ram":
                what = f"{data['alternate']['tokens']:,}: two documents in turn / --cache-ram"
                out.append(Target(what=what, ratio=f.ratio, bound=1.15))
    return out
