"""Corruption sweep: every damaged block file is refused with a reason, never loaded.

Store level: many block files, each damaged many ways (truncated at several
offsets, bits flipped, a 4 KiB page zeroed, garbage appended, swapped with
another file of the same size, replaced by another model's block): every read
raises ``BlockCorrupt`` with a reason, nothing else, and ``verify`` lists it.
Engine level (the tiny model): with a damaged file in the cache, the answer is
the uncached one.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from localkv.storage.store import BlockCorrupt, BlockRow, SnapshotStore
from support.reliability import long_run, record
from support.store import OTHER_IDENTITY, make_chain, put_chain
from support.tinymodels import TinyModels, tiny_config

from localkv.model.sampling import SamplingParams
from localkv.prompt.request import Document
from localkv.runtime import Runtime

Damage = Callable[[bytes, "Others"], bytes]


class Others:
    """Bytes a damage may borrow: a same-size file of another block, another model's block."""

    def __init__(self, same_size: bytes | None, other_model: bytes) -> None:
        self.same_size = same_size
        self.other_model = other_model


def _truncate(at: float) -> Damage:
    return lambda data, _: data[: int(len(data) * at)]


def _flip(at: float, bit: int) -> Damage:
    def damage(data: bytes, _: Others) -> bytes:
        i = min(len(data) - 1, int(len(data) * at))
        return data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1 :]

    return damage


def _zero_page(page: int) -> Damage:
    def damage(data: bytes, _: Others) -> bytes:
        begin = min(page * 4096, max(0, len(data) - 4096))
        return data[:begin] + bytes(min(4096, len(data) - begin)) + data[begin + 4096 :]

    return damage


DAMAGES: dict[str, Damage] = {
    **{f"truncate@{at}": _truncate(at) for at in (0.0, 0.001, 0.02, 0.5, 0.999)},
    "truncate-1": lambda data, _: data[:-1],
    **{f"flip@{at}/{bit}": _flip(at, bit) for at, bit in ((0, 0), (0.003, 7), (0.5, 3), (1, 1))},
    "zero page 0": _zero_page(0),
    "zero page 1": _zero_page(1),
    "append 1 byte": lambda data, _: data + b"\0",
    "append 4 KiB garbage": lambda data, _: data + np.random.default_rng(0).bytes(4096),
    "swap same size": lambda data, o: o.same_size if o.same_size is not None else data[:-1],
    "other model's block": lambda data, o: o.other_model,
    "empty": lambda data, _: b"",
}


def _sizes(store: SnapshotStore, rows: list[BlockRow]) -> dict[int, list[BlockRow]]:
    by_size: dict[int, list[BlockRow]] = {}
    for r in rows:
        by_size.setdefault(r.stored_bytes, []).append(r)
    return by_size


def test_every_damaged_block_is_refused_with_a_reason(tmp_path: Path) -> None:
    tokens = [int(t) for t in np.random.default_rng(5).integers(1, 30000, 64 * 24)]
    with SnapshotStore.open(tmp_path / "other") as other_store:
        others = make_chain(tokens, 64, identity=OTHER_IDENTITY)
        put_chain(other_store, others)
        other_files = {
            r.start: (other_store.root / r.file).read_bytes()
            for r in other_store.match_chain([b.hash for b in others])
        }
    refused = 0
    reasons: dict[str, int] = {}
    with SnapshotStore.open(tmp_path / "cache") as store:
        blocks = make_chain(tokens, 64)
        put_chain(store, blocks)
        rows = store.match_chain([b.hash for b in blocks])
        by_size = _sizes(store, rows)
        for row in rows:
            path = store.root / row.file
            pristine = path.read_bytes()
            twins = [r for r in by_size[row.stored_bytes] if r.hash != row.hash]
            same = (store.root / twins[0].file).read_bytes() if twins else None
            extra = Others(same, other_files[row.start])
            for name, damage in DAMAGES.items():
                damaged = damage(pristine, extra)
                assert damaged != pristine, name
                path.write_bytes(damaged)
                with pytest.raises(BlockCorrupt) as info:
                    store.read_blocks([row])
                assert info.value.reason and info.value.block_hash == row.hash, name
                key = info.value.reason.split(":")[0].split(" ")[0]
                reasons[key] = reasons.get(key, 0) + 1
                refused += 1
            path.write_bytes(pristine)
            assert store.read_blocks([row])[0].hash == row.hash
        assert store.verify() == []
        assert refused == len(rows) * len(DAMAGES)
    record(
        "corruption.store",
        files=len(rows),
        kinds=len(DAMAGES),
        corruptions=refused,
        refused=refused,
        reasons=reasons,
    )


SYSTEM = "You answer questions about the document."
GREEDY = SamplingParams(temperature=0, max_tokens=12)
ENGINE_DAMAGES = ["truncate@0.5", "flip@0.5/3", "zero page 0", "append 1 byte", "swap same size"]


def _prefilled(model: Path, cache: Path, doc: Document) -> list[Path]:
    with Runtime(tiny_config(model), cache_dir=cache) as rt:
        assert rt.prefill([doc], system=SYSTEM).snapshot is not None
        assert rt.cache is not None
        rows = rt.cache.store.all_blocks()
    return [cache / r.file for r in sorted(rows, key=lambda r: (r.start, -r.n_tokens))]


def _engine_sweep(
    tiny_models: TinyModels, tmp_path: Path, doc: Document, damages: list[str], every: bool
) -> dict[str, int]:
    """Damage one block file (``every``: the first, middle and last in turn) per run."""
    question = "What is the document about?"
    with Runtime(tiny_config(tiny_models.base), use_cache=False) as rt:
        uncached = rt.ask([doc], question, system=SYSTEM, params=GREEDY)
    pristine = tmp_path / "pristine"
    files = _prefilled(tiny_models.base, pristine, doc)
    other = _prefilled(tiny_models.other_weights, tmp_path / "other", doc)
    answers = 0
    for name in damages:
        for index in sorted({0, len(files) // 2, len(files) - 1} if every else {len(files) // 2}):
            work = tmp_path / "work"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(pristine, work)
            target = work / files[index].relative_to(pristine)
            data = target.read_bytes()
            same = [f for f in files if f != files[index] and f.stat().st_size == len(data)]
            extra = Others(same[0].read_bytes() if same else None, other[index].read_bytes())
            target.write_bytes(DAMAGES[name](data, extra))
            with Runtime(tiny_config(tiny_models.base), cache_dir=work) as rt:
                answer = rt.ask([doc], question, system=SYSTEM, params=GREEDY)
                doc_end = rt.build([doc], system=SYSTEM).boundaries[-1]
            assert answer.text == uncached.text, (name, index)
            assert answer.cache.reused < doc_end, (name, index)
            answers += 1
    return {"kinds": len(damages), "answers_equal_uncached": answers}


@pytest.fixture()
def doc(long_text: str) -> Document:
    return Document.from_text(long_text[:2500], "doc.txt")


def test_with_a_damaged_block_the_answer_is_the_uncached_one(
    tiny_models: TinyModels, tmp_path: Path, doc: Document
) -> None:
    damages = [*ENGINE_DAMAGES, "other model's block"]
    record("corruption.engine", **_engine_sweep(tiny_models, tmp_path, doc, damages, False))


@long_run
def test_every_damage_through_the_engine(
    tiny_models: TinyModels, tmp_path: Path, long_text: str
) -> None:
    doc = Document.from_text(long_text[:6000], "doc.txt")
    record(
        "corruption.engine.long", **_engine_sweep(tiny_models, tmp_path, doc, list(DAMAGES), True)
    )
