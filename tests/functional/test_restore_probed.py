"""A chain whose probe matched restores again without a decode (``cache.restore.probed``).

The second restore loads the final token's rows instead of decoding it: the
state, and the logits after it, must be the probed restore's and an uncached
run's bit for bit. What it must not skip: a new process's first restore, a
chain that was not probed, a block whose file changed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from support.stored import store_prefill
from support.tinymodels import TinyModels, tiny_config

from localkv.cache.prefix import PrefixCache
from localkv.cache.restore.probed import ProbedChains
from localkv.model.session import ModelSession, SessionConfig
from localkv.runtime import Runtime

BLOCK = 16


@pytest.fixture(autouse=True)
def _no_packed_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every restore here reads its blocks (a packed state is probed as it loads:
    ``test_packed_states``)."""
    monkeypatch.setattr(PrefixCache, "packing", False)


def _tokens(n: int, seed: int = 11) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(200, 40000, n)]


@contextmanager
def _counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The number of tokens of each llama.cpp decode of any session, while inside."""
    seen: list[int] = []
    real = ModelSession._decode

    def counting(self: ModelSession, tokens: list[int], **kw: object) -> object:
        seen.append(len(tokens))
        return real(self, tokens, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ModelSession, "_decode", counting)
    try:
        yield seen
    finally:
        monkeypatch.setattr(ModelSession, "_decode", real)


def _restore(rt: Runtime, request: list[int], stored: int) -> tuple[int, bytes, np.ndarray]:
    assert rt.cache is not None
    ends = rt.session.schedule(len(request), [stored, len(request)])
    result = rt.cache.restore(rt.session, request, ends)
    assert result.verified is True
    return result.reused, rt.session.capture_state(), rt.session.decode_one(request[result.reused])


def _uncached(
    cfg: SessionConfig, request: list[int], stored: int, reused: int
) -> tuple[bytes, np.ndarray]:
    with ModelSession(cfg) as fresh:
        fresh.prefill(request[:reused], ends=fresh.schedule(len(request), [stored, len(request)]))
        return fresh.capture_state(), fresh.decode_one(request[reused])


@pytest.mark.parametrize("flash_attn", ["off", "on"])
def test_a_probed_chain_restores_again_without_a_decode_and_the_same_bits(
    tiny_models: TinyModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flash_attn: str
) -> None:
    cfg = tiny_config(tiny_models.base, block_size=BLOCK, flash_attn=flash_attn)
    tokens = _tokens(6 * BLOCK + 5)
    request = [*tokens, 7, 8]
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        assert rt.cache is not None
        with _counted(monkeypatch) as decodes:
            first = _restore(rt, request, len(tokens))
            assert decodes == [1, 1]  # the probe, then the next token
            decodes.clear()
            again = _restore(rt, request, len(tokens))
            assert decodes == [1]  # the next token only: no probe
            decodes.clear()
            # a prefix of the probed chain, ending at one of its blocks: no probe either
            shorter = [*tokens[: 3 * BLOCK], 9, 10]
            prefix = _restore(rt, shorter, 3 * BLOCK)
            assert decodes == [1] and prefix[0] == 3 * BLOCK
    assert first[0] == again[0] == len(tokens)
    assert again[1] == first[1]
    assert np.array_equal(again[2], first[2])
    assert (again[1], again[2].tobytes()) == _bits(_uncached(cfg, request, len(tokens), first[0]))
    assert (prefix[1], prefix[2].tobytes()) == _bits(_uncached(cfg, shorter, 3 * BLOCK, prefix[0]))


def _bits(pair: tuple[bytes, np.ndarray]) -> tuple[bytes, bytes]:
    return pair[0], pair[1].tobytes()


def test_a_request_ending_where_the_chain_ends_gets_its_logits_from_the_probe(
    tiny_models: TinyModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny_config(tiny_models.base, block_size=BLOCK)
    tokens = _tokens(3 * BLOCK + 4, seed=14)
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        rt.session.prefill(tokens, boundaries=[len(tokens)])
        expected = rt.session.last_logits
        assert rt.cache is not None and expected is not None
        rt.cache.write(rt.cache.prepare(rt.session, [len(tokens)], 0.001))
        ends = rt.session.schedule(len(tokens), [len(tokens)])
        for _ in range(2):  # the second time, the chain was probed before
            rt.session.reset()
            with _counted(monkeypatch) as decodes:
                result = rt.cache.restore(rt.session, tokens, ends)
            assert result.reused == len(tokens) and decodes == [1]  # the probe
            logits = rt.session.last_logits
            assert logits is not None and np.array_equal(logits, expected)


def test_a_new_process_probes_again(
    tiny_models: TinyModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny_config(tiny_models.base, block_size=BLOCK)
    tokens = _tokens(4 * BLOCK + 3, seed=12)
    request = [*tokens, 7]
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        assert rt.cache is not None
        _restore(rt, request, len(tokens))
    with Runtime(cfg, cache_dir=tmp_path) as rt, _counted(monkeypatch) as decodes:
        reused, _, _ = _restore(rt, request, len(tokens))
    assert reused == len(tokens) and decodes == [1, 1]  # probed, then the next token


def test_a_block_damaged_after_its_probe_is_not_trusted(
    tiny_models: TinyModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny_config(tiny_models.base, block_size=BLOCK)
    tokens = _tokens(5 * BLOCK + 2, seed=13)
    request = [*tokens, 7]
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        store_prefill(rt, tokens)
        assert rt.cache is not None
        _restore(rt, request, len(tokens))
        bad = next(r for r in rt.cache.store.all_blocks() if r.start == 3 * BLOCK)
        path = tmp_path / bad.file
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10  # in its rows: the checksum catches it as it is read
        path.write_bytes(bytes(data))
        with _counted(monkeypatch) as decodes:
            reused, state, logits = _restore(rt, request, len(tokens))
        assert not rt.cache.store.has_block(bad.hash)  # quarantined
    assert reused == 3 * BLOCK  # the blocks before it, a prefix of the probed chain
    assert decodes == [1]  # that prefix was probed before: the next token only
    assert (state, logits.tobytes()) == _bits(_uncached(cfg, request, len(tokens), reused))


@dataclass(frozen=True)
class _Row:
    hash: str
    checksum: str


def _row(h: str, checksum: str) -> _Row:
    return _Row(h, checksum)


def test_the_record_wants_every_block_with_its_checksum_and_is_bounded() -> None:
    probed = ProbedChains(max_blocks=3)
    chain = [_row("a", "x1"), _row("b", "x2")]
    assert not probed.matched(chain) and not probed.matched([])
    probed.add(chain)
    assert probed.matched(chain) and probed.matched(chain[:1])
    assert not probed.matched([chain[0], _row("b", "x3")])  # the file changed
    assert not probed.matched([*chain, _row("c", "x4")])  # a block never probed
    probed.add([_row("c", "x4"), _row("d", "x5")])
    assert not probed.matched(chain[:1])  # the oldest, forgotten
    assert probed.matched([_row("b", "x2"), _row("c", "x4"), _row("d", "x5")])
