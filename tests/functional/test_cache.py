"""The verified prefix cache on the tiny model: what it reuses, and what it must refuse."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from support.tinymodels import TinyModels, tiny_config

from localkv.cache.prefix import PrefixCache, RestoreResult
from localkv.model.sampling import SamplingParams
from localkv.model.session import LoraSpec
from localkv.prompt.request import Document, Request
from localkv.runtime import Runtime

GREEDY = SamplingParams(temperature=0, max_tokens=16)
SYSTEM = "You answer questions about the document."


def _runtime(path: Path, cache: Path, **kw: object) -> Runtime:
    namespace = str(kw.pop("namespace", "default"))
    compact = bool(kw.pop("compact", False))
    return Runtime(
        tiny_config(path, **kw), cache_dir=cache, namespace=namespace, compact_cache=compact
    )


@pytest.fixture()
def doc(long_text: str) -> Document:
    return Document.from_text(long_text[:3000], "doc.txt")


def _save_tokens(rt: Runtime, tokens: list[int]) -> None:
    """Prefill raw tokens with a tip at their end and save them."""
    assert rt.cache is not None
    rt.session.reset()
    rt.session.prefill(tokens, boundaries=[len(tokens)])
    rt.cache.write(rt.cache.prepare(rt.session, [len(tokens)], 0.001))


def _restore(rt: Runtime, request: list[int] | Request) -> RestoreResult:
    """Restore a request (raw tokens: one segment) on its canonical schedule."""
    assert rt.cache is not None
    if not isinstance(request, Request):
        request = Request(request, [len(request)])
    result = rt.cache.restore(rt.session, request.tokens, rt.schedule(request))
    assert result.reused == rt.session.n_tokens
    if result.reused:
        assert result.verified is True
        assert rt.session.tokens == request.tokens[: result.reused]
    return result


def _reuse(rt: Runtime, request: list[int] | Request) -> int:
    return _restore(rt, request).reused


def test_seed_example_reuses_exactly_two(tiny_models: TinyModels, tmp_path: Path) -> None:
    """One token per batch (block size 1): every token ends a batch, so 2 are exact."""
    with _runtime(tiny_models.base, tmp_path, block_size=1) as rt:
        _save_tokens(rt, [11, 24, 31, 42, 57])
        assert _reuse(rt, [11, 24, 99, 42, 57]) == 2
        assert _reuse(rt, [11, 24, 31, 42, 57, 60]) == 5
        # the whole stored request: n-1 restored... and the last decoded: all 5 usable
        assert _reuse(rt, [11, 24, 31, 42, 57]) == 5
        assert _reuse(rt, [99, 24, 31, 42, 57]) == 0


def test_seed_example_in_one_batch_reuses_none_of_the_two(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    """Batched as [31, 42 | 57]: no batch ends after 11, 24, so nothing is exact."""
    with _runtime(tiny_models.base, tmp_path) as rt:
        _save_tokens(rt, [11, 24, 31, 42, 57])
        result = _restore(rt, [11, 24, 99, 42, 57])
        assert (result.reused, result.common) == (0, 2)
        # less than a block in common is a first run, however it was batched
        assert result.miss_reason == "not cached yet"
        # uncached, the longer request batches [11 .. 57 | 60]: the stored [11 .. 42 | 57]
        # is another computation from its first batch on
        longer = _restore(rt, [11, 24, 31, 42, 57, 60])
        assert (longer.reused, longer.common) == (0, 5)


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "compact"])
@pytest.mark.parametrize("p", [1, 100, 255, 256, 300, 599])
def test_a_different_token_at_p_reuses_up_to_the_last_shared_batch_end(
    tiny_models: TinyModels, tmp_path: Path, long_text: str, p: int, compact: bool
) -> None:
    with _runtime(tiny_models.base, tmp_path, compact=compact) as rt:
        tokens = rt.session.tokenize(long_text)[:700]
        _save_tokens(rt, tokens)
        stored_ends = rt.session.batch_ends
        assert stored_ends == [255, 256, 511, 512, 699, 700]
        changed = list(tokens)
        changed[p] = (tokens[p] + 1) % rt.session.n_vocab
        result = _restore(rt, changed)
        assert result.common == p
        assert result.reused == max((e for e in stored_ends if e <= p), default=0)


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "compact"])
def test_shifted_document_is_not_reused(
    tiny_models: TinyModels, tmp_path: Path, doc: Document, compact: bool
) -> None:
    with _runtime(tiny_models.base, tmp_path, compact=compact) as rt:
        rt.prefill([doc], system=SYSTEM)
        other = rt.build([doc], system="A different, longer system prompt for this test.")
        first = rt.build([doc], system=SYSTEM)
        common = next(
            i for i, (a, b) in enumerate(zip(first.tokens, other.tokens, strict=False)) if a != b
        )
        result = _restore(rt, other)
        assert result.common == common < first.boundaries[0]
        assert result.reused <= common


@pytest.mark.parametrize(
    ("variant", "kw", "field"),
    [
        ("other_weights", {}, "model_sha256"),
        ("q8_0", {}, "model_sha256"),
        ("base", {"lora": 1.0}, "loras"),
        ("base", {"type_k": "q8_0"}, "type_k"),
        ("base", {"rope_freq_base": 20000.0}, "rope_freq_base"),
        ("base", {"namespace": "work"}, "namespace"),
    ],
)
@pytest.mark.parametrize("compact", [False, True], ids=["plain", "compact"])
def test_other_computations_reuse_nothing_and_say_why(
    tiny_models: TinyModels,
    tmp_path: Path,
    doc: Document,
    variant: str,
    kw: dict[str, object],
    field: str,
    compact: bool,
) -> None:
    with _runtime(tiny_models.base, tmp_path, compact=compact) as rt:
        rt.prefill([doc], system=SYSTEM)
    options = dict(kw)
    if "lora" in options:
        options["loras"] = (LoraSpec(tiny_models.lora, float(options.pop("lora"))),)  # type: ignore[arg-type]
    with _runtime(getattr(tiny_models, variant), tmp_path, **options) as rt:
        request = rt.build([doc], system=SYSTEM)
        assert rt.cache is not None
        result = rt.cache.restore(rt.session, request.tokens, rt.schedule(request))
        assert result.reused == 0
        assert rt.session.n_tokens == 0
        assert result.miss_reason is not None
        assert field in result.miss_reason


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "compact"])
@pytest.mark.parametrize("flash_attn", ["auto", "off"])  # off: V is stored transposed
def test_cached_answer_equals_uncached(
    tiny_models: TinyModels, tmp_path: Path, doc: Document, flash_attn: str, compact: bool
) -> None:
    question = "What is the document about?"
    with _runtime(tiny_models.base, tmp_path, flash_attn=flash_attn, compact=compact) as rt:
        rt.prefill([doc], system=SYSTEM)
        assert rt.cache is not None
        stats = rt.cache.store.stats()
        assert (stats["stored_bytes"] < stats["raw_bytes"]) == compact
    with _runtime(tiny_models.base, tmp_path, flash_attn=flash_attn) as rt:
        cached = rt.ask([doc], question, system=SYSTEM, params=GREEDY)
        doc_end = rt.build([doc], system=SYSTEM).boundaries[-1]
    config = tiny_config(tiny_models.base, flash_attn=flash_attn)
    with Runtime(config, use_cache=False) as rt:
        uncached = rt.ask([doc], question, system=SYSTEM, params=GREEDY)
    assert cached.cache.hit and cached.cache.verified
    assert cached.tokens.reused == doc_end
    assert cached.text == uncached.text
    assert cached.tokens.generated == uncached.tokens.generated > 0


def _block_files(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "blocks").rglob("*") if p.is_file())


@pytest.mark.parametrize("damage", ["flip header", "flip data", "truncate", "delete"])
def test_a_damaged_block_is_a_miss_with_a_reason(
    tiny_models: TinyModels, tmp_path: Path, doc: Document, damage: str
) -> None:
    question = "Summarize."
    with _runtime(tiny_models.base, tmp_path) as rt:
        report = rt.prefill([doc], system=SYSTEM)
        assert rt.cache is not None
        store = rt.cache.store
        chain = store.chain_of(store.get_snapshot(report.snapshot or "").tip)
        assert len(chain) >= 2
        target = store.root / chain[len(chain) // 2].file  # a block the document needs
    data = target.read_bytes()
    if damage.startswith("flip"):
        at = 100 if damage == "flip header" else len(data) - 100
        target.write_bytes(data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :])
    elif damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    else:
        target.unlink()
    with _runtime(tiny_models.base, tmp_path) as rt:
        answer = rt.ask([doc], question, system=SYSTEM, params=GREEDY)
        doc_end = rt.build([doc], system=SYSTEM).boundaries[-1]
    with Runtime(tiny_config(tiny_models.base), use_cache=False) as rt:
        uncached = rt.ask([doc], question, system=SYSTEM, params=GREEDY)
    assert answer.text == uncached.text
    # the damaged block and everything after it were not used
    assert answer.cache.reused < doc_end
    assert answer.cache.miss_reason or answer.cache.hit


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "compact"])
def test_altered_values_with_a_consistent_checksum_are_caught_by_the_probe(
    tiny_models: TinyModels, tmp_path: Path, doc: Document, compact: bool
) -> None:
    with _runtime(tiny_models.base, tmp_path, compact=compact) as rt:
        report = rt.prefill([doc], system=SYSTEM)
        assert rt.cache is not None
        store = rt.cache.store
        chain = store.chain_of(store.get_snapshot(report.snapshot or "").tip)
        last = chain[-1]
        (block,) = store.read_blocks([last])
        tensors = {k: np.array(v) for k, v in block.tensors.items()}
        k0 = tensors["k.0"]
        k0[-3:] = k0[-3:] * 1.5 + 0.25  # other values, written as a valid block
        forged = dataclasses.replace(block, tensors=tensors)
        store.quarantine(last.hash, "replaced by the test")
        assert store.put_block(forged)
        (row,) = store.match_chain([last.hash])
        assert (row.stored_bytes < row.raw_bytes) == compact
        request = rt.build([doc], system=SYSTEM)
        result = rt.cache.restore(rt.session, request.tokens, rt.schedule(request))
        assert result.reused == 0
        assert result.miss_reason is not None and "probe" in result.miss_reason
        assert rt.session.n_tokens == 0
        assert not store.has_block(last.hash)  # quarantined


def test_saving_twice_writes_nothing_new(
    tiny_models: TinyModels, tmp_path: Path, doc: Document
) -> None:
    with _runtime(tiny_models.base, tmp_path) as rt:
        first = rt.prefill([doc], system=SYSTEM)
        files = _block_files(tmp_path)
        second = rt.prefill([doc], system=SYSTEM)
    # every file written, the shorter block where the system prompt ends included
    assert first.new_blocks == len(files) >= first.blocks > 0
    assert second.new_blocks == 0
    assert second.reused == second.tokens
    assert _block_files(tmp_path) == files
    assert second.snapshot == first.snapshot


def test_blocks_shared_by_two_documents_are_stored_once(
    tiny_models: TinyModels, tmp_path: Path, long_text: str
) -> None:
    system = "S " * 300  # longer than a block, shared by both
    a = Document.from_text(long_text[:1500], "a.txt")
    b = Document.from_text(long_text[1500:3000], "b.txt")
    with _runtime(tiny_models.base, tmp_path) as rt:
        ra = rt.prefill([a], system=system)
        rb = rt.prefill([b], system=system)
        system_end = rt.build([], system=system).boundaries[0]
        ta, tb = rt.build([a], system=system).tokens, rt.build([b], system=system).tokens
    common = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
    # everything the two requests share: the system prompt and the next turn's header
    assert system_end <= common < system_end + 8
    # the turn header after the system prompt was batched with a's text, not b's: the
    # reuse ends where the system prompt's last token was decoded alone
    assert (rb.reused, rb.cache.common) == (system_end, common)
    assert rb.new_blocks < rb.blocks
    assert ra.snapshot != rb.snapshot


def test_a_small_budget_evicts_but_keeps_the_pinned_snapshot(
    tiny_models: TinyModels, tmp_path: Path, long_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = Document.from_text(long_text[:3000], "a.txt")
    b = Document.from_text(long_text[3000:6000], "b.txt")
    with _runtime(tiny_models.base, tmp_path) as rt:
        pinned = rt.prefill([a], system=SYSTEM, pin=True)
        assert pinned.bytes_on_disk > 0
        monkeypatch.setenv("LOCALKV_BUDGET", str(pinned.bytes_on_disk + 1000))
        rt.prefill([b], system=SYSTEM)  # over budget: b's blocks go, a's stay
        assert rt.cache is not None
        kept = rt.cache.store.chain_of(rt.cache.store.get_snapshot(pinned.snapshot or "").tip)
        assert sum(r.stored_bytes for r in kept) == pinned.bytes_on_disk
        request = rt.build([a], system=SYSTEM)
        assert _reuse(rt, request) == len(request.tokens)
        other = rt.build([b], system=SYSTEM)
        assert _reuse(rt, other) < len(other.tokens) - 256


def test_bookkeeping_runs_off_the_restore_path(
    tiny_models: TinyModels, tmp_path: Path, doc: Document
) -> None:
    """Hit counts are written by the background worker, not before the first token."""
    with _runtime(tiny_models.base, tmp_path) as rt:
        rt.prefill([doc], system=SYSTEM)
        assert rt.cache is not None
        ran_on: list[str] = []
        seen_texts: list[int] = []  # answer texts sent when an event was recorded
        store = rt.cache.store
        original = store.record_event

        def spy(*args: object, **kw: object) -> None:
            import threading

            ran_on.append(threading.current_thread().name)
            seen_texts.append(len(texts))
            original(*args, **kw)  # type: ignore[arg-type]

        store.record_event = spy  # type: ignore[method-assign]
        texts: list[str] = []
        answer = rt.ask([doc], "Why?", system=SYSTEM, params=GREEDY, on_text=texts.append)
        rt.wait_for_saves()
        assert answer.text and answer.cache.hit
        assert ran_on and all(name.startswith("localkv-save") for name in ran_on)
        assert store.stats()["hits"] >= 1
        # and not beside the question's prefill or the answer's decode: after the answer
        assert seen_texts and min(seen_texts) == len(texts) >= 1


def test_a_transposed_v_is_staged_a_block_at_a_time(
    tiny_models: TinyModels, tmp_path: Path, doc: Document, monkeypatch: pytest.MonkeyPatch
) -> None:
    from localkv.cache.restore import pieces

    staging = pieces._Staging()
    monkeypatch.setattr(pieces, "_STAGING", staging)
    asked: list[int] = []
    take = staging.take

    def noted(nbytes: int) -> np.ndarray:
        asked.append(nbytes)
        return take(nbytes)

    monkeypatch.setattr(staging, "take", noted)
    monkeypatch.setattr(PrefixCache, "packing", False)  # the restore reads the blocks
    with _runtime(tiny_models.base, tmp_path) as rt:
        rt.prefill([doc], system=SYSTEM)
        answer = rt.ask([doc], "Why?", system=SYSTEM, params=GREEDY)
        kv = rt.session.capture()
        assert answer.cache.hit and kv.v_trans  # flash attention off: the CPU default here
        assert rt.cache is not None
        readers, block = rt.cache.store.readers, rt.session.config.block_size
    v_bytes = {layer.v_row_bytes for layer in kv.layers}
    assert len(v_bytes) == 1 and len(kv.layers) >= 2
    token_v = v_bytes.pop() * len(kv.layers)
    # the restored V rows of every layer (the chain's final token is probed, not loaded),
    # staged once each, a block's at a time: never the chain's, nor a piece's
    loaded = answer.tokens.reused - 1
    assert loaded > 2 * block
    assert sum(asked) == loaded * token_v
    assert len(asked) == -(-answer.tokens.reused // block)
    assert max(asked) == block * token_v
    # each given back: as many are held as were in use at once
    assert 1 <= len(staging.held()) <= max(1, readers)
