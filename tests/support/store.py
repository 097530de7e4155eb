"""Helpers shared by the store tests (this module holds no tests itself)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from localkv.storage.chain import chain_hashes, chain_next, chain_root
from localkv.storage.store import Block, Probe, SnapshotStore

IDENTITY = "sha256:" + "1" * 64
OTHER_IDENTITY = "sha256:" + "2" * 64
ROW_BYTES = 48


def logits_for(seed: int, vocab: int = 200) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(vocab).astype(np.float32)


def tensors_for(tokens: np.ndarray, start: int, n_layers: int = 2) -> dict[str, np.ndarray]:
    """Deterministic per-token rows: float16 K, uint8 V (like a quantized cache)."""
    n = tokens.shape[0]
    out: dict[str, np.ndarray] = {}
    for layer in range(n_layers):
        pos = np.arange(start, start + n, dtype=np.float32)[:, None]
        base = tokens.astype(np.float32)[:, None] * 0.01 + pos * 0.001
        out[f"k.{layer}"] = (
            base + np.linspace(0, 1, ROW_BYTES // 2, dtype=np.float32) + layer
        ).astype(np.float16)
        out[f"v.{layer}"] = (
            ((tokens[:, None] * 7 + pos.astype(np.int64) + layer) % 251)
            .astype(np.uint8)
            .repeat(ROW_BYTES // 8, axis=1)
        )
    return out


def tail_alone(n: int) -> list[int]:
    """Batch ends of a block of ``n`` tokens whose last token was decoded alone."""
    return [n - 1, n] if n > 1 else [1]


def grid_ends(n: int, block_size: int) -> list[int]:
    """Absolute batch ends of ``make_chain``'s blocks over ``n`` tokens."""
    ends: list[int] = []
    for start in range(0, n, block_size):
        ends.extend(start + e for e in tail_alone(min(block_size, n - start)))
    return ends


def grid_hashes(root: str, tokens: Sequence[int], block_size: int) -> list[str]:
    """``chain_hashes`` of the full blocks ``make_chain`` writes for ``tokens``."""
    return chain_hashes(root, tokens, block_size, grid_ends(len(tokens), block_size))


def make_chain(
    tokens: Sequence[int],
    block_size: int,
    *,
    identity: str = IDENTITY,
    namespace: str = "",
) -> list[Block]:
    """The blocks of ``tokens``: full blocks, then a shorter tail block if any remain."""
    arr = np.asarray(tokens, dtype=np.int32)
    parent: str | None = None
    blocks: list[Block] = []
    for start in range(0, arr.shape[0], block_size):
        part = arr[start : start + block_size]
        ends = tail_alone(part.shape[0])
        h = chain_next(parent or chain_root(identity, namespace), part, ends)
        blocks.append(
            Block(
                hash=h,
                parent=parent,
                identity=identity,
                namespace=namespace,
                start=start,
                tokens=part,
                ends=np.asarray(ends),
                tensors=tensors_for(part, start),
                probe=Probe.from_logits(logits_for(start + int(part[-1]))),
                meta={"codec": "test", "n_layer": "2"},
                prefill_seconds=0.01 * part.shape[0],
            )
        )
        parent = h
    return blocks


def put_chain(store: SnapshotStore, blocks: Sequence[Block]) -> int:
    return sum(store.put_block(b) for b in blocks)


def block_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "blocks").rglob("*.lkv"))


def put_in_process(root: str, tokens: list[int], block_size: int) -> int:
    """Open the store at ``root`` and save a chain (run in another process)."""
    with SnapshotStore.open(Path(root)) as store:
        return put_chain(store, make_chain(tokens, block_size))
