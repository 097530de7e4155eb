"""A restore into device memory reads each block once and holds no second copy of the state.

llama.cpp takes a sequence's state from host memory (``llama_state_seq_set_data``),
then copies it into the KV tensors in the device's buffers. A restore fills one
reused piece buffer at a time (``PIECE_BYTES`` of rows at most, one block at least)
and loads it, so while the state goes to the device the host holds a piece, not the
state: the resident set's peak rises by about a piece, the Python and numpy
allocations (tracemalloc) stay under a piece, and the block files are read once.

A software device computes slowly, so the state is kept to a dozen MB and the piece
scaled down with it (to one block's rows): the state is six pieces. The model is a
tiny one shaped for a large state per token (many layers, every head with its own K
and V). The restore runs on a thread of its own, whose piece buffer is fresh (the
buffer is per thread), so its cost is counted as a first restore's in a fresh process.
"""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from localkv.storage import SnapshotStore
from localkv.storage.filehash import FileHasher
from support.gpu import GPU_SET
from support.tinymodels import build_tiny_llama, tiny_config

from localkv.bench.geometry.counters import io_now
from localkv.bench.stats import peak_memory
from localkv.bench.text import prompt_tokens
from localkv.cache.identity import identity_of
from localkv.cache.prefix import PrefixCache, RestoreResult
from localkv.cache.restore import pieces
from localkv.model.devices import Device
from localkv.model.native import llama_cpp
from localkv.model.session import ModelSession

pytestmark = GPU_SET

TOKENS = 384
BLOCK = 64
# 64 layers of 2 heads of 64, K and V each (f16): 32 KiB a token, 12 MiB for TOKENS
SHAPE = {"n_layer": 64, "n_embd": 128, "n_head": 2, "n_head_kv": 2, "n_ff": 32}
PIECE = BLOCK * 32 << 10  # one block's rows: the least a piece holds
# what a restore may hold beside its piece: the spill of the final token, one
# layer's V rows on their way to being transposed, the backend's staging of one
# tensor's rows, the tokens and the results
SLACK = 4 << 20
READ_SLACK = 1 << 20  # the index's pages and the block headers' reads


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    path = tmp_path_factory.mktemp("wide") / "wide.gguf"
    return build_tiny_llama(path, default_model_path, name="localkv-wide", **SHAPE)


@pytest.fixture()
def session(wide_model: Path, device: Device) -> Iterator[ModelSession]:
    config = tiny_config(wide_model, n_ctx=TOKENS + BLOCK, n_gpu_layers=-1, block_size=BLOCK)
    with ModelSession(config) as s:
        assert s.in_pieces and s.offload.layers == s.offload.of, s.offload.split()
        assert device.label() in s.offload.backend()
        yield s


def _on_a_fresh_thread(fn: Callable[[], RestoreResult]) -> RestoreResult:
    """``fn`` on a new thread (a fresh piece buffer); what it returned, or its error."""
    out: list[RestoreResult] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # raised again on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def test_a_restore_to_the_device_reads_the_blocks_once_and_holds_a_piece(
    session: ModelSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pieces, "PIECE_BYTES", PIECE)
    tokens = prompt_tokens(session, TOKENS)
    ends = session.schedule(TOKENS, [TOKENS])
    deferred: list[Callable[[], None]] = []
    with SnapshotStore.open(tmp_path / "store") as store:
        cache = PrefixCache(
            store, identity_of(session, FileHasher()), "test", BLOCK, defer=deferred.append
        )
        session.prefill(tokens, ends=ends)
        saved = cache.write(cache.prepare(session, [TOKENS], 0.0))
        assert saved.tip is not None
        blocks_bytes = sum(r.stored_bytes for r in store.chain_of(saved.tip))
        session.reset()

        results: list[RestoreResult] = []
        before = io_now()
        tracemalloc.start()
        try:
            peak = peak_memory(
                lambda: results.append(
                    _on_a_fresh_thread(lambda: cache.restore(session, tokens, ends))
                )
            )
            _, traced_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        read = (io_now() - before).rchar
        for fn in deferred:
            fn()

    result = results[0]

    state = int(llama_cpp.llama_state_seq_get_size(session.ctx, 0))
    assert result.reused == TOKENS and result.verified
    assert state >= 5 * PIECE, f"the state ({state:,} B) must be pieces large"
    assert blocks_bytes <= read <= blocks_bytes + READ_SLACK, (read, blocks_bytes)
    assert peak.method.startswith("VmHWM"), f"no resettable peak here: {peak.method}"
    assert peak.delta_bytes <= PIECE + SLACK, (peak.delta_bytes, state)
    assert traced_peak <= PIECE + SLACK, (traced_peak, state)
