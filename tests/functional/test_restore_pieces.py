"""A plain KV restore a piece at a time (``cache.restore.pieces``): the same bits, less memory.

The context gets a second sequence in the same cells for it; a prefill there must
give the bits a one-sequence context gives, and a restore in pieces the state a
whole restore gives. A damaged block in a later piece leaves nothing behind.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from support.stored import store_prefill
from support.tinyarch import build
from support.tinymodels import TinyModels, tiny_config

from localkv.cache.prefix import PrefixCache
from localkv.cache.restore import pieces
from localkv.model import loading
from localkv.model.native import llama_cpp
from localkv.model.session import ModelSession
from localkv.model.state import RESTORE_SEQ
from localkv.runtime import Runtime

BLOCK = 16
KV_SETTINGS = [("off", "f16"), ("on", "f16"), ("on", "q8_0")]  # a quantized V needs it on


@pytest.fixture(autouse=True)
def _no_packed_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every restore here reads its blocks: none goes through a packed state."""
    monkeypatch.setattr(PrefixCache, "packing", False)


def _tokens(n: int, seed: int = 3) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(200, 40000, n)]


def _after(session: ModelSession, token: int) -> tuple[bytes, np.ndarray]:
    """The state of sequence 0, then the logits of ``token`` decoded next."""
    return session.capture_state(), session.decode_one(token)


@pytest.mark.parametrize(("flash_attn", "kv"), KV_SETTINGS)
def test_a_second_sequence_changes_no_bit(
    tiny_models: TinyModels, monkeypatch: pytest.MonkeyPatch, flash_attn: str, kv: str
) -> None:
    cfg = tiny_config(tiny_models.base, flash_attn=flash_attn, type_k=kv, type_v=kv)
    tokens = _tokens(3 * 64 + 7)
    with ModelSession(cfg) as two:
        assert two.in_pieces
        two.prefill(tokens[:-1], boundaries=[50, len(tokens) - 1])
        with_two = _after(two, tokens[-1])
    monkeypatch.setattr(loading, "_plain_kv", lambda model: False)
    with ModelSession(cfg) as one:
        assert not one.in_pieces
        one.prefill(tokens[:-1], boundaries=[50, len(tokens) - 1])
        with_one = _after(one, tokens[-1])
    assert with_two[0] == with_one[0]
    assert np.array_equal(with_two[1], with_one[1])


def _restored(rt: Runtime, tokens: list[int], stored: int) -> tuple[int, bytes, np.ndarray]:
    """Restore ``tokens``, whose first ``stored`` are a segment the cache holds."""
    assert rt.cache is not None
    ends = rt.session.schedule(len(tokens), [stored, len(tokens)])
    result = rt.cache.restore(rt.session, tokens, ends)
    assert result.verified is True
    # nothing is left in the sequence a piece goes through
    assert llama_cpp.llama_memory_seq_pos_max(rt.session.memory, RESTORE_SEQ) == -1
    state, logits = _after(rt.session, tokens[result.reused])
    return result.reused, state, logits


@pytest.mark.parametrize(("flash_attn", "kv"), KV_SETTINGS)
def test_a_restore_in_pieces_is_the_whole_restore(
    tiny_models: TinyModels,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flash_attn: str,
    kv: str,
) -> None:
    cfg = tiny_config(
        tiny_models.base, block_size=BLOCK, flash_attn=flash_attn, type_k=kv, type_v=kv
    )
    tokens = _tokens(10 * BLOCK + 5)
    request = [*tokens, 7, 8, 9]
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        assert rt.cache is not None
        rt.session.in_pieces = False
        whole = _restored(rt, request, len(tokens))
        assert rt.session._scratch is not None  # the whole state, assembled in one buffer
        rt.session.in_pieces, rt.session._scratch = True, None
        in_one = _restored(rt, request, len(tokens))  # every block fits one piece
        per_token = len(whole[1]) // whole[0]
        monkeypatch.setattr(pieces, "PIECE_BYTES", 3 * BLOCK * per_token // 2)
        assert len(_groups(rt, request)) == 10  # a block each, the short last one with another
        pieces._PIECE.__init__()  # they only grow, per thread
        each_block = _restored(rt, request, len(tokens))
        assert rt.session._scratch is None  # no buffer of the whole state was made
        held = [b for b in pieces._PIECE.buffers if b is not None]
        assert held and sum(b.shape[0] for b in held) < len(whole[1])
    assert whole[0] == len(tokens) and in_one[0] == each_block[0] == whole[0]
    assert in_one[1] == each_block[1] == whole[1]
    assert np.array_equal(in_one[2], whole[2]) and np.array_equal(each_block[2], whole[2])


@pytest.mark.parametrize("blocks", [2, 1])
@pytest.mark.parametrize(("flash_attn", "kv"), KV_SETTINGS)
def test_pieces_read_ahead_restore_the_whole_restore(
    tiny_models: TinyModels,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flash_attn: str,
    kv: str,
    blocks: int,
) -> None:
    # two readers; two blocks a piece: one piece is read (a block on each reader) while one
    # loads; a block that fills a piece alone (a large model's): two pieces are
    # read, one on each reader. Each piece read ahead has a buffer of its own.
    cfg = tiny_config(
        tiny_models.base,
        block_size=BLOCK,
        flash_attn=flash_attn,
        type_k=kv,
        type_v=kv,
        n_threads=2,
    )
    tokens = _tokens(10 * BLOCK + 5, seed=8)
    request = [*tokens, 7, 8, 9]
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        _two_readers(rt)
        store_prefill(rt, tokens)
        rt.session.in_pieces = False
        whole = _restored(rt, request, len(tokens))
        rt.session.in_pieces, rt.session._scratch = True, None
        per_token = len(whole[1]) // whole[0]
        monkeypatch.setattr(pieces, "PIECE_BYTES", blocks * BLOCK * per_token + BLOCK)
        assert pieces.parallel_reads(rt.session)
        ahead_n = pieces.pieces_ahead(per_token, BLOCK, rt.cache.store.readers)
        assert ahead_n == {2: 1, 1: 2}[blocks]
        plan = [len(g) for g in _groups(rt, request)]
        assert plan == ([2] * 5 + [1] if blocks == 2 else [1] * 11)
        to_readers: list[int] = []
        fill = rt.cache.store.start_fill_blocks

        def noted(opened: list[object], *args: object, **kwargs: object) -> object:
            to_readers.append(len(opened))
            return fill(opened, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(rt.cache.store, "start_fill_blocks", noted)
        pieces._PIECE.__init__()
        ahead = _restored(rt, request, len(tokens))
        # the pieces read ahead went into buffers of their own while one loaded
        buffers = pieces._PIECE.buffers
        assert len(buffers) == ahead_n + 1 and all(b is not None for b in buffers)
        assert to_readers == plan  # every piece went to the readers, one block ones too
    assert ahead[0] == whole[0] == len(tokens)
    assert ahead[1] == whole[1]
    assert np.array_equal(ahead[2], whole[2])


def _groups(rt: Runtime, request: list[int]) -> list[list[object]]:
    """How the chain ``request`` restores is read in pieces."""
    assert rt.cache is not None
    ends = rt.session.schedule(len(request), [len(request) - 3, len(request)])
    plan = rt.cache.plan(request, ends)
    opened = rt.cache.store.open_blocks(plan.chain)
    try:
        n = opened[-1].row.end - 1
        per_token = len(rt.session.capture_state()) // max(1, rt.session.n_tokens)
        return pieces.groups(opened, n, per_token)  # type: ignore[return-value]
    finally:
        for block_file in opened:
            block_file.close()


@pytest.mark.parametrize("blocks", [0, 1, 2])
def test_a_damaged_block_in_a_later_piece_leaves_the_prefix_before_it(
    tiny_models: TinyModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocks: int
) -> None:
    # blocks: a block a piece read on this thread (0), or on two reader threads with the
    # next pieces read while one loads, one block a piece (two read ahead) or two (one)
    cfg = tiny_config(tiny_models.base, block_size=BLOCK, n_threads=2 if blocks else 1)
    tokens = _tokens(8 * BLOCK + 3, seed=4)
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        _two_readers(rt)
        store_prefill(rt, tokens)
        assert rt.cache is not None
        rows = sorted(rt.cache.store.all_blocks(), key=lambda r: r.start)
        bad = next(r for r in rows if r.start == 5 * BLOCK)
        path = tmp_path / bad.file
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10  # in its rows: the checksum catches it as it is read
        path.write_bytes(bytes(data))
        per_token = len(rt.session.capture_state()) // max(1, rt.session.n_tokens)
        monkeypatch.setattr(pieces, "PIECE_BYTES", max(1, blocks) * BLOCK * per_token)
        assert pieces.parallel_reads(rt.session) == bool(blocks)
        ahead = pieces.pieces_ahead(per_token, BLOCK, rt.cache.store.readers)
        assert ahead == {0: 2, 1: 2, 2: 1}[blocks]  # (none read ahead without parallel reads)
        reused, state, logits = _restored(rt, [*tokens, 7], len(tokens))
        assert reused == 5 * BLOCK  # the blocks before the damaged one, verified again
        assert not rt.cache.store.has_block(bad.hash)  # quarantined
    with ModelSession(cfg) as fresh:  # the same prefix, computed in the same batches
        fresh.prefill(tokens[:reused], ends=fresh.schedule(len(tokens), [len(tokens)]))
        fresh_state, fresh_logits = _after(fresh, tokens[reused])
    assert fresh_state == state
    assert np.array_equal(fresh_logits, logits)


def test_pieces_ahead_keep_every_reader_busy_within_a_bound() -> None:
    block, per_token = 256, 1 << 10  # a piece of PIECE_BYTES holds 64 blocks of 256 KiB
    many = pieces.PIECE_BYTES // (block * per_token)
    assert pieces.pieces_ahead(per_token, block, 1) == 0  # one reader: none read ahead
    assert pieces.pieces_ahead(per_token, block, 2) == 1
    assert pieces.pieces_ahead(per_token * many, block, 2) == 2  # a block a piece
    assert pieces.pieces_ahead(per_token * many * 4, block, 2) == 2  # a block over a piece
    assert pieces.pieces_ahead(per_token * many, block, 8) == pieces.MAX_AHEAD
    assert pieces.pieces_ahead(per_token * many // 2, block, 8) == min(pieces.MAX_AHEAD, 4)


def _two_readers(rt: Runtime) -> None:
    """Give the store two reader threads, whatever this machine's cores (before it reads)."""
    assert rt.cache is not None
    rt.cache.store._workers = 2  # the pool is made on the first read


@pytest.mark.parametrize(("flash_attn", "kv"), KV_SETTINGS)
def test_a_save_after_stored_blocks_reads_only_the_rows_after_them(
    tiny_models: TinyModels, tmp_path: Path, flash_attn: str, kv: str
) -> None:
    from localkv.cache.save import _capture
    from localkv.model.state import STATE_WORK

    cfg = tiny_config(
        tiny_models.base, block_size=BLOCK, flash_attn=flash_attn, type_k=kv, type_v=kv
    )
    tokens = _tokens(6 * BLOCK + 5, seed=6)
    turn = 4 * BLOCK + 2  # the first turn's end: its blocks are stored before the second's
    with Runtime(cfg, cache_dir=tmp_path / "two") as rt:
        assert rt.cache is not None
        ends = rt.session.schedule(len(tokens), [turn, len(tokens)])
        rt.session.prefill(tokens[:turn], ends=ends)
        rt.cache.write(rt.cache.prepare(rt.session, [turn], 0.001))
        rt.session.prefill(tokens[turn:], ends=ends)
        whole = rt.session.capture()
        part = _capture(rt.session, 4 * BLOCK)
        assert part.positions.tolist() == list(range(4 * BLOCK, len(tokens)))
        for a, b in zip(whole.slice(4 * BLOCK, len(tokens)).layers, part.layers, strict=True):
            assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)
        before = STATE_WORK.captured_bytes
        rt.cache.write(rt.cache.prepare(rt.session, [turn, len(tokens)], 0.001))
        read = STATE_WORK.captured_bytes - before
        assert 0 < read < len(rt.session.capture_state()) * 3 // 5  # 2 of 6 blocks and a bit
        rt.session.reset()
        # what the second save wrote restores, verified, as the whole prefix
        request = [*tokens, 5]
        ends = rt.session.schedule(len(request), [turn, len(tokens), len(request)])
        result = rt.cache.restore(rt.session, request, ends)
        assert result.verified and result.reused == len(tokens)
        restored = _after(rt.session, 5)
    with Runtime(cfg, use_cache=False) as rt:  # no cache: the same tokens in the same batches
        rt.session.prefill(tokens, ends=rt.session.schedule(len(tokens), [turn, len(tokens)]))
        fresh = _after(rt.session, 5)
    assert restored[0] == fresh[0] and np.array_equal(restored[1], fresh[1])


def test_a_restore_in_pieces_tells_its_loads_and_columns_apart(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    cfg = tiny_config(tiny_models.base, block_size=BLOCK, flash_attn="off")
    tokens = _tokens(6 * BLOCK + 5, seed=5)
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        assert rt.cache is not None
        ends = rt.session.schedule(len(tokens) + 1, [len(tokens), len(tokens) + 1])
        result = rt.cache.restore(rt.session, [*tokens, 7], ends)
    assert result.verified and rt.session.in_pieces
    steps = result.breakdown
    assert set(steps) == {"lookup", "read", "columns", "load", "probe"}
    # the pieces' loads are the load step (not ~0, as when they were counted as reading)
    assert steps["load"] > 0 and steps["columns"] > 0 and steps["read"] > 0
    # columns is a part of reading: the four steps still add up to the restore
    four = steps["lookup"] + steps["read"] + steps["load"] + steps["probe"]
    assert four <= result.seconds


def test_buffers_made_ready_are_the_ones_a_restore_uses(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    cfg = tiny_config(tiny_models.base, block_size=BLOCK, flash_attn="off")
    tokens = _tokens(12 * BLOCK + 5, seed=6)
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        assert rt.cache is not None
        pieces._PIECE.__init__()  # as in a fresh thread
        assert rt.prepare_restores() > 0
        buffers, staged = list(pieces._PIECE.buffers), pieces._STAGING.held()
        assert buffers[:1] and buffers[0] is not None and staged
        reused, _, _ = _restored(rt, [*tokens, 7], len(tokens))
        assert reused == len(tokens)
        # the restore grew no buffer: it used the pages made ready
        assert all(a is b for a, b in zip(pieces._PIECE.buffers, buffers, strict=True))
        # and took no staging area but those, each given back
        assert {id(a) for a in pieces._STAGING.held()} == {id(a) for a in staged}


def test_staging_areas_are_reused_and_their_number_does_not_grow() -> None:
    staging = pieces._Staging()
    assert staging.ready(2, 100) == 200  # made, and touched
    a, b = staging.take(50), staging.take(100)
    assert {a.shape[0], b.shape[0]} == {100}
    c = staging.take(10)  # none free: a new one
    for area in (a, b, c):
        staging.give(area)
    assert len(staging.held()) == 3
    big = staging.take(1000)  # none fits: made in place of the largest free one
    assert big.shape[0] >= 1000 and len(staging.held()) == 2
    staging.give(big)
    assert staging.ready(1, 500) >= 1000 and [x is big for x in staging.held()] == [True]


def test_a_staging_area_too_small_everywhere_replaces_the_largest_wherever_it_is() -> None:
    # areas of other sizes, the largest not first: a larger take (a longer chain's layer
    # after a shorter one's) drops that one, and no other (compared as arrays, they differ)
    staging = pieces._Staging()
    small, large = staging.take(10), staging.take(100)
    staging.give(small)
    staging.give(large)
    big = staging.take(1000)
    assert big.shape[0] >= 1000 and [x is small for x in staging.held()] == [True]


def test_a_restore_once_made_ready_starts_no_thread(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    cfg = tiny_config(tiny_models.base, block_size=BLOCK, flash_attn="off", n_threads=2)
    tokens = _tokens(12 * BLOCK + 5, seed=7)
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        assert rt.cache is not None and pieces.parallel_reads(rt.session)
        rt.prepare_restores()
        before = {t.ident for t in threading.enumerate()}
        reused, _, _ = _restored(rt, [*tokens, 7], len(tokens))
        assert reused == len(tokens)
        # the store's readers were all started by then: the restore started none
        new = [t.name for t in threading.enumerate() if t.ident not in before]
        assert not [name for name in new if name.startswith("localkv-read")], new


def test_no_buffers_are_made_for_memory_restored_otherwise(
    tiny_models: TinyModels, tmp_path: Path, default_model_path: Path
) -> None:
    gemma3 = build(tmp_path / "gemma3.gguf", "gemma3", default_model_path)
    with Runtime(tiny_config(gemma3), cache_dir=tmp_path / "cache") as rt:
        assert rt.session.memory_kind == "swa"
        assert rt.prepare_restores() == 0
    with Runtime(tiny_config(tiny_models.base), use_cache=False) as rt:
        assert rt.prepare_restores() == 0
