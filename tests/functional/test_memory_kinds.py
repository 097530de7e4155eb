"""SWA, hybrid and recurrent memory cached end to end (tiny models; Gemma 3 270M).

The tiny models: gemma3 (SWA), lfm2, nemotron_h and qwen35 (hybrid; qwen35's M-RoPE
KV cells carry llama.cpp's cell extension), mamba2 (recurrent).

A stored partial state (SWA window, recurrent state) is used only at a snapshot
boundary, verified by the probe, and a cached answer equals the uncached one:
the same tokens and the same final logits, bit for bit.
"""

from __future__ import annotations

import json
import sqlite3
import struct
from pathlib import Path

import numpy as np
import pytest
from localkv.storage import SnapshotStore
from support.tinyarch import TinyArchModels
from support.tinymodels import tiny_config

from localkv.kv.blocks import PARTIAL
from localkv.model.sampling import SamplingParams
from localkv.prompt.request import Document
from localkv.runtime import Runtime
from localkv.runtime.reports import Answer

GREEDY = SamplingParams(temperature=0, max_tokens=64)
QUESTION = "What was Alice doing?"
BLOCK = 256
TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of "
    "having nothing to do: once or twice she had peeped into the book her sister was reading. "
)


def _doc(n_chapters: int = 52, changed_at: int | None = None) -> Document:
    chapters = [f"Chapter {i}. {TEXT}" for i in range(n_chapters)]
    if changed_at is not None:
        chapters[changed_at] = f"Chapter {changed_at}. The Queen of Hearts shouted at everyone."
    return Document.from_text(" ".join(chapters), "doc.txt")


def _ask(path: Path, cache: Path | None, doc: Document, **kw: object) -> tuple[Answer, np.ndarray]:
    config = tiny_config(path, n_ctx=4096, **kw)  # type: ignore[arg-type]
    with Runtime(config, cache_dir=cache, use_cache=cache is not None) as rt:
        answer = rt.ask([doc], QUESTION, params=GREEDY)
        logits = rt.session.last_logits
        assert logits is not None
        return answer, logits.copy()


def _prefill(path: Path, cache: Path, doc: Document, **kw: object) -> int:
    with Runtime(tiny_config(path, n_ctx=4096, **kw), cache_dir=cache) as rt:
        assert rt.cache is not None, rt.cache_error
        return rt.prefill([doc]).tokens


def _same(a: tuple[Answer, np.ndarray], b: tuple[Answer, np.ndarray]) -> None:
    assert a[0].text == b[0].text
    assert np.array_equal(a[1].view(np.uint32), b[1].view(np.uint32))


@pytest.mark.parametrize("arch", ["gemma3", "lfm2", "nemotron_h", "mamba2", "qwen35"])
def test_a_prefilled_document_is_reused_verified_and_exact(
    arch: str, arch_models: TinyArchModels, tmp_path: Path
) -> None:
    path = arch_models.all()[arch]
    doc = _doc()
    n_doc = _prefill(path, tmp_path, doc)
    assert 2000 <= n_doc <= 2400
    cached = _ask(path, tmp_path, doc)
    assert cached[0].cache.verified is True
    assert cached[0].tokens.reused >= 0.9 * n_doc
    _same(cached, _ask(path, None, doc))


@pytest.mark.parametrize("arch", ["lfm2", "qwen35"])
def test_with_v_transposed_a_document_is_reused_verified_and_exact(
    arch: str, arch_models: TinyArchModels, tmp_path: Path
) -> None:
    """Flash attention off: the restore assembles the blocks' rows (M-RoPE cells included)."""
    path, doc = arch_models.all()[arch], _doc()
    n_doc = _prefill(path, tmp_path, doc, flash_attn="off")
    cached = _ask(path, tmp_path, doc, flash_attn="off")
    assert cached[0].cache.verified is True
    assert cached[0].tokens.reused >= 0.9 * n_doc
    _same(cached, _ask(path, None, doc, flash_attn="off"))


@pytest.mark.parametrize("arch", ["gemma3", "lfm2", "nemotron_h", "qwen35"])
def test_a_changed_document_reuses_up_to_the_last_snapshot_before_the_change(
    arch: str, arch_models: TinyArchModels, tmp_path: Path
) -> None:
    path = arch_models.all()[arch]
    _prefill(path, tmp_path, _doc())
    changed = _doc(changed_at=20)
    with Runtime(tiny_config(path, n_ctx=4096), cache_dir=tmp_path) as rt:
        original = rt.build([_doc()], system=None).tokens
        request = rt.build([changed], system=None).tokens
    p = next(i for i, (a, b) in enumerate(zip(original, request, strict=False)) if a != b)
    cached = _ask(path, tmp_path, changed)
    reused = cached[0].tokens.reused
    assert reused <= p
    assert reused >= (p // BLOCK) * BLOCK
    assert reused % BLOCK == 0  # a snapshot boundary, never a trimmed state
    _same(cached, _ask(path, None, changed))


def test_other_weights_reuse_nothing_and_name_the_field(
    arch_models: TinyArchModels, tmp_path: Path
) -> None:
    doc = _doc()
    _prefill(arch_models.gemma3, tmp_path, doc)
    other = _ask(arch_models.gemma3_other, tmp_path, doc)
    assert other[0].tokens.reused == 0
    assert "model_sha256" in (other[0].cache.miss_reason or "")
    _same(other, _ask(arch_models.gemma3_other, None, doc))


def test_another_kv_type_reuses_nothing(arch_models: TinyArchModels, tmp_path: Path) -> None:
    doc = _doc()
    _prefill(arch_models.gemma3, tmp_path, doc)
    q8 = _ask(arch_models.gemma3, tmp_path, doc, type_k="q8_0")
    assert q8[0].tokens.reused == 0
    assert "type_k" in (q8[0].cache.miss_reason or "")


def _damage_partial(cache: Path, start: int, truncate: bool) -> None:
    """Flip a byte in the partial state of the stored block at ``start``, or cut its file."""
    conn = sqlite3.connect(cache / "index.db")
    try:
        ((file,),) = conn.execute("SELECT file FROM blocks WHERE start = ?", (start,)).fetchall()
    finally:
        conn.close()
    target = cache / file
    data = bytearray(target.read_bytes())
    if truncate:
        target.write_bytes(bytes(data[: len(data) - 100]))
        return
    (n,) = struct.unpack_from("<Q", data, 0)
    begin, end = json.loads(data[8 : 8 + n])[PARTIAL]["data_offsets"]
    data[8 + n + (begin + end) // 2] ^= 0x01
    target.write_bytes(bytes(data))


@pytest.mark.parametrize("truncate", [False, True])
def test_a_damaged_snapshot_where_the_restore_ends_is_a_miss_and_the_answer_is_uncached(
    truncate: bool, arch_models: TinyArchModels, tmp_path: Path
) -> None:
    doc, path = _doc(), arch_models.lfm2
    n_doc = _prefill(path, tmp_path, doc)
    tip = (n_doc - 1) // BLOCK * BLOCK  # the document's last block: where the restore ends
    _damage_partial(tmp_path, tip, truncate)
    cached = _ask(path, tmp_path, doc)
    assert cached[0].tokens.reused <= tip  # nothing past the damage
    assert "corrupt block" in (cached[0].cache.miss_reason or "")
    _same(cached, _ask(path, None, doc))


def test_a_damaged_snapshot_a_restore_passes_is_never_read(
    arch_models: TinyArchModels, tmp_path: Path
) -> None:
    """Only the last block's partial state is loaded, so only it is read; verify finds the rest."""
    doc, path = _doc(), arch_models.lfm2
    n_doc = _prefill(path, tmp_path, doc)
    _damage_partial(tmp_path, 2 * BLOCK, truncate=False)
    cached = _ask(path, tmp_path, doc)
    assert cached[0].cache.verified is True
    assert cached[0].tokens.reused >= 0.9 * n_doc
    _same(cached, _ask(path, None, doc))
    with SnapshotStore.open(tmp_path) as store:
        bad = store.verify()
    assert [reason for _, reason in bad] == ["tensor 'partial' differs from its checksum"]


@pytest.mark.parametrize("arch", ["gemma3", "lfm2", "nemotron_h", "mamba2", "qwen35"])
def test_memory_that_cannot_be_trimmed_is_emptied_not_cut(
    arch: str, arch_models: TinyArchModels
) -> None:
    with Runtime(tiny_config(arch_models.all()[arch]), use_cache=False) as rt:
        tokens = rt.session.tokenize(TEXT * 4)
        rt.session.prefill(tokens)
        rt.session.truncate(len(tokens) - 5)
        assert rt.session.n_tokens == 0


@pytest.mark.default_model
def test_gemma3_270m_document_reused_verified_and_exact(gemma3_path: Path, tmp_path: Path) -> None:
    doc = _doc(48)  # about 2,100 Gemma tokens: SWA snapshots are every 256
    n_doc = _prefill(gemma3_path, tmp_path, doc)
    assert n_doc >= 2000
    cached = _ask(gemma3_path, tmp_path, doc)
    assert cached[0].cache.verified is True
    assert cached[0].tokens.reused >= 0.9 * n_doc
    _same(cached, _ask(gemma3_path, None, doc))
