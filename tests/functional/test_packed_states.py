"""Packed states (``cache.restore.packed``, ``storage.packed``): the same bits, or none used.

A chain restored from its blocks is packed off the restore's path; the next restore, in
the same process or a new one, maps the packed file and loads it whole. Its state and the
logits after it must be the bits an uncached run computes; a file that is damaged, another
chain's, cut short or wrong in a way only the probe sees is removed, and the restore reads
the blocks instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from localkv.storage import NewSnapshot
from localkv.storage.packed import KEEP, PackedStates
from localkv.storage.paths import prepare_root
from support.stored import store_prefill
from support.tinymodels import TinyModels, tiny_config

from localkv.cache.budgeting import namespace_stats, stats_lines
from localkv.cache.prefix import RestoreResult
from localkv.model.session import ModelSession, SessionConfig
from localkv.runtime import Runtime

BLOCK = 16
KV_SETTINGS = [("off", "f16"), ("on", "f16"), ("on", "q8_0")]  # a quantized V needs it on


def _tokens(n: int, seed: int = 3) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(200, 40000, n)]


def _config(tiny_models: TinyModels, flash_attn: str = "off", kv: str = "f16") -> SessionConfig:
    return tiny_config(
        tiny_models.base, block_size=BLOCK, flash_attn=flash_attn, type_k=kv, type_v=kv
    )


def _restore(
    rt: Runtime, request: list[int], stored: int
) -> tuple[RestoreResult, bytes, np.ndarray]:
    """Restore ``request`` (its first ``stored`` tokens are stored); the result, the state,
    and the logits of the next token decoded after it."""
    assert rt.cache is not None
    ends = rt.session.schedule(len(request), [stored, len(request)])
    result = rt.cache.restore(rt.session, request, ends)
    assert result.verified is True
    state = rt.session.capture_state()
    return result, state, rt.session.decode_one(request[result.reused])


def _uncached(
    cfg: SessionConfig, tokens: list[int], n: int, stored: int
) -> tuple[bytes, np.ndarray]:
    """The state of ``tokens[:n]`` computed in the batches a request storing ``stored``
    tokens computes them in, and the logits of token ``n`` after it."""
    with ModelSession(cfg) as fresh:
        fresh.prefill(tokens[:n], ends=fresh.schedule(len(tokens), [stored, len(tokens)]))
        return fresh.capture_state(), fresh.decode_one(tokens[n])


def _packed_tip(rt: Runtime) -> str:
    assert rt.cache is not None
    listing = rt.cache.store.packed.listing()
    assert len(listing) == 1
    return listing[0][0]


@pytest.mark.parametrize(("flash_attn", "kv"), KV_SETTINGS)
def test_a_packed_state_restores_the_uncached_bits_after_a_restart(
    tiny_models: TinyModels, tmp_path: Path, flash_attn: str, kv: str
) -> None:
    cfg = _config(tiny_models, flash_attn, kv)
    tokens = _tokens(9 * BLOCK + 5)
    request = [*tokens, 7, 8, 9]
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        assert rt.cache is not None
        from_blocks = _restore(rt, request, len(tokens))
        assert not from_blocks[0].packed  # read from its blocks, and packed after
        rt.work.wait()
        tip = _packed_tip(rt)
        assert tip == from_blocks[0].tip
        again = _restore(rt, request, len(tokens))
        assert again[0].packed  # in the same process
    with Runtime(cfg, cache_dir=tmp_path) as rt:  # and in the next one
        restarted = _restore(rt, request, len(tokens))
        assert restarted[0].packed and set(restarted[0].breakdown) == {
            "lookup",
            "read",
            "load",
            "probe",
        }
    reused = from_blocks[0].reused
    assert reused == again[0].reused == restarted[0].reused == len(tokens)
    fresh = _uncached(cfg, request, reused, len(tokens))
    for state, logits in (again[1:], restarted[1:]):
        assert state == from_blocks[1] == fresh[0]
        assert np.array_equal(logits, from_blocks[2]) and np.array_equal(logits, fresh[1])


def _packed_once(rt: Runtime, request: list[int], stored: int) -> Path:
    """Restore ``request`` once, so its chain is packed; the packed file."""
    assert rt.cache is not None
    _restore(rt, request, stored)
    rt.work.wait()
    return rt.cache.store.packed.path(_packed_tip(rt))


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage", ["a byte", "cut short", "another chain's", "not a file", "a fifo"]
)
def test_a_packed_state_that_fails_a_check_is_removed_and_the_blocks_restore(
    tiny_models: TinyModels, tmp_path: Path, damage: str
) -> None:
    cfg = _config(tiny_models)
    tokens, other = _tokens(6 * BLOCK + 3, seed=4), _tokens(6 * BLOCK + 3, seed=5)
    request = [*tokens, 7]
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        path = _packed_once(rt, request, len(tokens))
        good = _restore(rt, request, len(tokens))
        assert good[0].packed
        if damage == "a byte":
            _flip(path, path.stat().st_size // 2)
        elif damage == "cut short":
            os.truncate(path, path.stat().st_size - 1)
        elif damage == "another chain's":  # its own digest holds: it names another tip
            assert rt.cache is not None
            rt.session.reset()
            store_prefill(rt, other)
            other_path = _packed_once_more(rt, [*other, 7], len(other), path)
            os.replace(other_path, path)
        elif damage == "a fifo":  # must not block the restore
            path.unlink()
            os.mkfifo(path)
        else:
            path.unlink()
            path.mkdir()
        fallback = _restore(rt, request, len(tokens))
        assert not fallback[0].packed and fallback[0].reused == len(tokens)
        assert fallback[0].miss_reason is None  # the blocks were whole: nothing was lost
        rt.work.wait()
        if damage != "not a file":  # removed, and packed again from the blocks
            assert path.is_file()
            assert _restore(rt, request, len(tokens))[0].packed
    assert fallback[1] == good[1]
    assert np.array_equal(fallback[2], good[2])


def _packed_once_more(rt: Runtime, request: list[int], stored: int, besides: Path) -> Path:
    """Pack a second chain; its packed file (``besides`` is the first's)."""
    assert rt.cache is not None
    _restore(rt, request, stored)
    rt.work.wait()
    paths = [rt.cache.store.packed.path(tip) for tip, _, _ in rt.cache.store.packed.listing()]
    (other,) = [p for p in paths if p != besides]
    return other


def test_a_packed_state_the_probe_refuses_is_removed_and_the_blocks_restore(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    cfg = _config(tiny_models)
    tokens = _tokens(6 * BLOCK + 3, seed=6)
    request = [*tokens, 7]
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        assert rt.cache is not None
        path = _packed_once(rt, request, len(tokens))
        packed = rt.cache.store.packed
        tip = _packed_tip(rt)
        found = packed.open(tip, len(tokens) - 1)
        assert found is not None and not isinstance(found, str)
        stream = found.stream.copy()
        found.close()
        stream[stream.shape[0] // 2] ^= 0x40  # in the rows: a state llama.cpp takes
        packed.remove(tip)

        def fill(buf: np.ndarray) -> None:
            buf[:] = stream

        packed.write(tip, len(tokens) - 1, stream.shape[0], fill)  # its digest holds
        fallback = _restore(rt, request, len(tokens))
        assert not fallback[0].packed and fallback[0].reused == len(tokens)
        assert rt.cache.store.has_block(tip)  # the blocks are not blamed for it
        rt.work.wait()  # packed again, from the blocks
        assert path.is_file()
        again = _restore(rt, request, len(tokens))
        assert again[0].packed
    fresh = _uncached(cfg, request, len(tokens), len(tokens))
    for state, logits in (fallback[1:], again[1:]):
        assert state == fresh[0] and np.array_equal(logits, fresh[1])


def test_packed_states_are_bounded_by_count_and_bytes(tmp_path: Path) -> None:
    states = PackedStates(prepare_root(tmp_path / "cache"))
    tips = [f"sha256:{i:064x}" for i in range(KEEP + 2)]
    for i, tip in enumerate(tips):

        def fill(buf: np.ndarray, i: int = i) -> None:
            buf[:] = i

        path = states.write(tip, 10, 1000, fill)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # each used after the one before
    assert states.prune(max_bytes=1 << 20) > 0
    kept = [tip for tip, _, _ in states.listing()]
    assert kept == tips[::-1][:KEEP]  # the most recently used
    states.used(tips[2])  # now the most recent
    states.prune(max_bytes=2 * 1100)  # two files and their trailers at most
    assert [tip for tip, _, _ in states.listing()] == [tips[2], tips[-1]]
    found = states.open(tips[2], 10)
    assert found is not None and not isinstance(found, str)
    try:
        assert found.check() is None and set(found.stream.tolist()) == {2}
    finally:
        found.close()
    assert states.open(tips[2], 11) == "packed state is another chain's"
    assert states.open(tips[0], 10) is None  # pruned


def test_a_state_over_the_share_of_the_budget_is_not_packed(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    tokens = _tokens(6 * BLOCK + 3, seed=7)
    with Runtime(_config(tiny_models), cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        assert rt.cache is not None
        rt.cache.budget_bytes = len(rt.session.capture_state())  # a quarter of it: short
        _restore(rt, [*tokens, 7], len(tokens))
        rt.work.wait()
        assert rt.cache.store.packed.listing() == []
        assert not _restore(rt, [*tokens, 7], len(tokens))[0].packed


@pytest.mark.parametrize("how", ["quarantine", "evict", "forget the snapshot"])
def test_a_chain_that_leaves_the_store_takes_its_packed_state(
    tiny_models: TinyModels, tmp_path: Path, how: str
) -> None:
    tokens = _tokens(6 * BLOCK + 3, seed=8)
    with Runtime(_config(tiny_models), cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        assert rt.cache is not None
        store = rt.cache.store
        path = _packed_once(rt, [*tokens, 7], len(tokens))
        tip = _packed_tip(rt)
        if how == "quarantine":
            store.quarantine(tip, "a test")
        elif how == "evict":
            store.evict(0)
        else:
            row = store.get_blocks([tip])[tip]
            named = NewSnapshot(
                tip=tip,
                label="a document",
                n_tokens=row.end,
                identity=row.identity,
                namespace=row.namespace,
            )
            store.remove_snapshot(store.put_snapshot(named))
        assert not store.has_block(tip)
        assert not path.exists() and store.packed.listing() == []


def test_cache_stats_count_the_packed_states_beside_the_budget(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    tokens = _tokens(6 * BLOCK + 3, seed=9)
    with Runtime(_config(tiny_models), cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        assert rt.cache is not None
        path = _packed_once(rt, [*tokens, 7], len(tokens))
        stats = namespace_stats(rt.cache.store, rt.namespace)
    budget = stats["budget"]
    assert isinstance(budget, dict)
    assert budget["packed_states"] == 1 and budget["packed_bytes"] == path.stat().st_size
    (line,) = [x for x in stats_lines(stats) if "packed states" in x]
    assert line.split(": ", 1)[1].startswith("1 beside it, ")


def test_a_packed_state_is_not_used_under_another_kv_type_or_after_other_tokens(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    tokens = _tokens(6 * BLOCK + 3, seed=10)
    with Runtime(_config(tiny_models, "on", "f16"), cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        path = _packed_once(rt, [*tokens, 7], len(tokens))
    packed = path.read_bytes()
    # another KV type: another identity, so another chain; the packed file is not reached
    with Runtime(_config(tiny_models, "on", "q8_0"), cache_dir=tmp_path) as rt:
        assert rt.cache is not None
        ends = rt.session.schedule(len(tokens) + 1, [len(tokens), len(tokens) + 1])
        result = rt.cache.restore(rt.session, [*tokens, 7], ends)
        assert result.reused == 0 and not result.packed
    # the same tokens after another first one: another chain, not this packed state
    with Runtime(_config(tiny_models, "on", "f16"), cache_dir=tmp_path) as rt:
        assert rt.cache is not None
        shifted = [tokens[0] + 1, *tokens[1:], 7]
        ends = rt.session.schedule(len(shifted), [len(tokens), len(shifted)])
        result = rt.cache.restore(rt.session, shifted, ends)
        assert result.reused == 0 and not result.packed
    assert path.read_bytes() == packed  # untouched: neither request could name it
