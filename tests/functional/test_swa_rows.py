"""Sliding-window blocks keep every row once; a restore assembles the window from them.

Tiny gemma3 models with a window narrower than a block (64) and one wider
than a block (300): a whole document comes back, verified, and the answer is
the uncached one bit for bit; the blocks hold each token's rows once; a
damaged row a restore uses is a miss, one it does not use is never read.
"""

from __future__ import annotations

import json
import os
import sqlite3
import struct
from pathlib import Path

import numpy as np
import pytest
from localkv.storage import SnapshotStore
from support.tinyarch import build
from support.tinymodels import tiny_config

from localkv.model.sampling import SamplingParams
from localkv.prompt.request import Document
from localkv.runtime import Runtime
from localkv.runtime.reports import Answer

SYSTEM = "Answer from the document."
QUESTION = "What was Alice doing?"
TEXT = "Alice was beginning to get very tired of sitting by her sister on the bank. "
SEEDED = SamplingParams(temperature=1.0, seed=3, max_tokens=24)


@pytest.fixture(scope="module", params=[64, 300], ids=["window-64", "window-300"])
def model(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_path: Path,
) -> Path:
    where = tmp_path_factory.mktemp("swa")
    return build(where / "gemma3.gguf", "gemma3", default_model_path, window=request.param)


def _doc(changed_at: int | None = None) -> Document:
    chapters = [f"Chapter {i}. {TEXT}" for i in range(90)]
    if changed_at is not None:
        chapters[changed_at] = f"Chapter {changed_at}. The Queen of Hearts shouted at everyone."
    return Document.from_text(" ".join(chapters), "doc.txt")


def _ask(model: Path, cache: Path | None, doc: Document) -> tuple[Answer, np.ndarray]:
    with Runtime(
        tiny_config(model, n_ctx=4096), cache_dir=cache, use_cache=cache is not None
    ) as rt:
        answer = rt.ask([doc], QUESTION, system=SYSTEM, params=SEEDED)
        logits = rt.session.last_logits
        assert logits is not None
        return answer, logits.copy()


def _same(a: tuple[Answer, np.ndarray], b: tuple[Answer, np.ndarray]) -> None:
    assert a[0].text == b[0].text
    assert np.array_equal(a[1].view(np.uint32), b[1].view(np.uint32))


def _prefill(model: Path, cache: Path, doc: Document) -> int:
    with Runtime(tiny_config(model, n_ctx=4096), cache_dir=cache) as rt:
        report = rt.prefill([doc], system=SYSTEM)
        assert report.kept == report.tokens
        return report.tokens


def _tensor_bytes(cache: Path) -> tuple[int, int, int]:
    """(tokens in full blocks and the tip, bytes of full-attention rows, of sliding rows)."""
    with SnapshotStore.open(cache) as store:
        (snap,) = store.snapshots()
        chain = store.chain_of(snap.tip)
        blocks = store.read_blocks(chain)
    full = sliding = 0
    for block in blocks:
        for name, arr in block.tensors.items():
            if name.startswith("w."):
                sliding += arr.nbytes
            elif name[:2] in ("k.", "v."):
                full += arr.nbytes
    return chain[-1].end, full, sliding


def test_a_whole_document_comes_back_and_answers_as_uncached(model: Path, tmp_path: Path) -> None:
    n_doc = _prefill(model, tmp_path, _doc())
    cached = _ask(model, tmp_path, _doc())
    assert cached[0].cache.verified is True
    assert cached[0].tokens.reused == n_doc
    _same(cached, _ask(model, None, _doc()))


def test_every_row_is_stored_once(model: Path, tmp_path: Path) -> None:
    _prefill(model, tmp_path, _doc())
    n, full, sliding = _tensor_bytes(tmp_path)
    with Runtime(tiny_config(model, n_ctx=4096), use_cache=False) as rt:
        tokens = rt.session.tokenize(TEXT * 8)[:600]
        rt.session.prefill(tokens)
        from localkv.model.partial_state import window_of

        state = rt.session.capture_array()
        base = rt.session.capture()
        window = window_of(state)
        per_base = sum(x.k_row_bytes + x.v_row_bytes for x in base.layers)
        per_sliding = sum(x.k_row_bytes + x.v_row_bytes for x in window.layers)
        width = rt.session.swa_window
    assert full == n * per_base  # the snapshot's chain holds each token's rows once
    blocks = -(-n // 256)
    # each block's sliding rows are those a window can still need: at most width + 1
    assert sliding <= min(n, blocks * (width + 1)) * per_sliding
    assert sliding >= min(n, (blocks - 1) * min(256, width)) * per_sliding


def test_a_changed_document_reuses_whole_blocks_before_the_change(
    model: Path, tmp_path: Path
) -> None:
    _prefill(model, tmp_path, _doc())
    with Runtime(tiny_config(model, n_ctx=4096), use_cache=False) as rt:
        a = rt.build([_doc()], system=SYSTEM, question=QUESTION).tokens
        b = rt.build([_doc(changed_at=40)], system=SYSTEM, question=QUESTION).tokens
    p = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    cached = _ask(model, tmp_path, _doc(changed_at=40))
    assert cached[0].cache.verified is True
    assert p // 256 * 256 == cached[0].tokens.reused
    _same(cached, _ask(model, None, _doc(changed_at=40)))


def _flip_sliding_row(cache: Path, start: int, position: int) -> None:
    conn = sqlite3.connect(cache / "index.db")
    try:
        ((file, end),) = conn.execute(
            "SELECT file, start + n_tokens FROM blocks WHERE start = ? ORDER BY n_tokens DESC "
            "LIMIT 1",
            (start,),
        ).fetchall()
    finally:
        conn.close()
    path = cache / file
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", data, 0)
    spec = json.loads(data[8 : 8 + n])["w.v.0"]
    rows = spec["shape"][0]
    row_bytes = (spec["data_offsets"][1] - spec["data_offsets"][0]) // rows
    index = position - (end - rows)
    assert 0 <= index < rows
    data[8 + n + spec["data_offsets"][0] + index * row_bytes] ^= 0x20
    path.write_bytes(bytes(data))


def test_a_damaged_row_in_the_window_is_a_miss_and_the_answer_uncached(
    model: Path, tmp_path: Path
) -> None:
    n_doc = _prefill(model, tmp_path, _doc())
    tip = (n_doc - 1) // 256 * 256
    _flip_sliding_row(tmp_path, tip, n_doc - 3)  # inside the window the restore assembles
    cached = _ask(model, tmp_path, _doc())
    assert cached[0].tokens.reused <= tip
    assert "corrupt block" in (cached[0].cache.miss_reason or "")
    _same(cached, _ask(model, None, _doc()))


def test_a_damaged_row_before_the_window_is_not_read(model: Path, tmp_path: Path) -> None:
    n_doc = _prefill(model, tmp_path, _doc())
    _flip_sliding_row(tmp_path, 256, 256 + 255)  # long before the document's last window
    cached = _ask(model, tmp_path, _doc())
    assert cached[0].cache.verified is True and cached[0].tokens.reused == n_doc
    _same(cached, _ask(model, None, _doc()))
    with SnapshotStore.open(tmp_path) as store:
        bad = store.verify()
    assert len(bad) == 1 and "tail rows" in bad[0][1]


def _flip_full_row(cache: Path, start: int) -> None:
    """Flip a byte of a full-attention layer's K rows in the block that starts at ``start``."""
    conn = sqlite3.connect(cache / "index.db")
    try:
        ((file,),) = conn.execute("SELECT file FROM blocks WHERE start = ?", (start,)).fetchall()
    finally:
        conn.close()
    path = cache / file
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", data, 0)
    begin, end = json.loads(data[8 : 8 + n])["k.0"]["data_offsets"]
    data[8 + n + (begin + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _needed_bytes(cache: Path) -> int:
    """The bytes of the rows a restore of the snapshot lays out: every full-attention
    row, and the sliding rows from the last block's window start."""
    with SnapshotStore.open(cache) as store:
        (snap,) = store.snapshots()
        chain = store.chain_of(snap.tip)
        blocks = store.read_blocks(chain)
    first = int(blocks[-1].meta["window_first"])
    needed = 0
    for row, block in zip(chain, blocks, strict=True):
        for name, arr in block.tensors.items():
            if name.startswith("w."):
                kept = max(0, row.end - max(first, row.end - arr.shape[0]))
                needed += kept * arr.nbytes // arr.shape[0]
            elif name[:2] in ("k.", "v."):
                needed += arr.nbytes
    return needed


def _restore_reads(model: Path, cache: Path, doc: Document) -> tuple[int, int] | None:
    """(bytes read from storage by a restore of ``doc`` with its block files out of
    the page cache, the bytes of the rows it needs); None where reads are not counted."""
    os.sync()
    for path in (cache / "blocks").rglob("*.lkv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    with Runtime(tiny_config(model, n_ctx=4096), cache_dir=cache) as rt:
        before = _read_bytes()
        answer = rt.ask([doc], QUESTION, system=SYSTEM, params=SamplingParams(max_tokens=1))
        read = _read_bytes() - before
    assert answer.cache.verified is True
    return (read, _needed_bytes(cache)) if read else None


def _read_bytes() -> int:
    with open("/proc/self/io", encoding="ascii") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("read_bytes"))


@pytest.mark.default_model
def test_gemma3_270m_changed_shifted_and_damaged_documents_answer_as_uncached(
    gemma3_path: Path, tmp_path: Path
) -> None:
    """The real Gemma 3 270M (a 512-token window): what a restore reuses is exact."""
    model, doc = gemma3_path, _doc()
    n_doc = _prefill(model, tmp_path, doc)
    assert n_doc > 3 * 512
    # from storage, a restore reads the rows it lays out and little more
    measured = _restore_reads(model, tmp_path, doc)
    if measured is not None:  # None: reads from storage are not counted (tmpfs)
        read, needed = measured
        assert needed <= read <= 1.1 * needed, measured
    # a damaged row the restore needs (a sliding row in the window, a full row earlier)
    tip = (n_doc - 1) // 256 * 256
    _flip_sliding_row(tmp_path, tip, n_doc - 3)
    _flip_full_row(tmp_path, 512)
    cached = _ask(model, tmp_path, doc)
    assert cached[0].tokens.reused <= 512
    assert "corrupt block" in (cached[0].cache.miss_reason or "")
    _same(cached, _ask(model, None, doc))
    # that ask stored the document again; a change past the window reuses the blocks before it
    changed = _doc(changed_at=60)
    with Runtime(tiny_config(model, n_ctx=4096), use_cache=False) as rt:
        a = rt.build([doc], system=SYSTEM, question=QUESTION).tokens
        b = rt.build([changed], system=SYSTEM, question=QUESTION).tokens
    p = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    cached = _ask(model, tmp_path, changed)
    assert cached[0].cache.verified is True and cached[0].tokens.reused == p // 256 * 256 > 512
    _same(cached, _ask(model, None, changed))
    # the same text after a preface: only the template's tokens before the document match
    shifted = Document.from_text("A preface. " + doc.text, "doc.txt")
    cached = _ask(model, tmp_path, shifted)
    assert cached[0].tokens.reused < 256
    _same(cached, _ask(model, None, shifted))
