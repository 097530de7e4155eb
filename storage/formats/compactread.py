"""Reading a compact block file (``planes``): whole, checked, then decoded into targets.

A compact file is read whole into a per-thread buffer and its digests checked
before anything is decoded: the index's checksum over all but the tensors kept
apart from it (``blockcodec.apart_specs``), the detached tensor's own digest
when it is wanted, and the tail groups from the first row wanted. Each split
tensor is then decoded straight into its targets (``q6``: one compiled call
per file); tensors stored whole are copied.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from ..disk import read_exactly
from ..values import DETACHED, TAIL_GROUP, BlockCorrupt, is_tail
from . import planes, q6
from .blockcodec import apart_specs
from .tails import TailHashes

if TYPE_CHECKING:
    from .readinto import OpenedBlock

__all__ = ["byte_view", "fill_planes", "scratch"]


def byte_view(arr: np.ndarray) -> memoryview:
    """A writable C-contiguous array's bytes (``ValueError`` for any other)."""
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError("a read target must be a writable C-contiguous array")
    return arr.reshape(-1).view(np.uint8).data


class _Scratch(threading.local):
    """Each reading thread's buffer for compact files' data sections (reused)."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, size: int) -> np.ndarray:
        if size > _KEEP_SCRATCH:
            return np.empty(size, dtype=np.uint8)
        buf = self.buffers.get(name)
        if buf is None or buf.shape[0] < size:
            buf = self.buffers[name] = np.empty(size, dtype=np.uint8)
        return buf[:size]


scratch = _Scratch()
_KEEP_SCRATCH = 64 << 20  # a larger buffer is not kept between reads


def _check_compact(
    opened: OpenedBlock, whole: memoryview, with_detached: bool, tails: TailHashes | None
) -> None:
    """A compact file's digests, its data section read whole (``BlockCorrupt`` if one differs)."""
    assert opened.physical is not None
    digest = xxhash.xxh3_128(opened.header)
    at = 0
    for spec in apart_specs(opened.metadata_all, opened.physical):
        digest.update(whole[at : spec.begin])
        at = spec.end
    digest.update(whole[at:])
    found = "xxh3:" + digest.hexdigest()
    if found != opened.row.checksum:
        raise BlockCorrupt(f"checksum {found} differs from the index's {opened.row.checksum}")
    kept = opened.physical.get(DETACHED) if opened.detached is not None else None
    if (
        kept is not None
        and with_detached
        and xxhash.xxh3_128_hexdigest(whole[kept.begin : kept.end]) != opened.detached
    ):
        raise BlockCorrupt(f"tensor {DETACHED!r} differs from its checksum")
    if tails is not None:
        first = tails.first * TAIL_GROUP
        for name in tails.names:
            spec = opened.physical[name]
            row_bytes = spec.nbytes // opened.tail_rows
            tails.update(name, whole[spec.begin + first * row_bytes : spec.end], first, row_bytes)
        tails.check()


def fill_planes(
    opened: OpenedBlock,
    own: dict[str, np.ndarray],
    placed: list[tuple[str, list[memoryview]]],
    with_detached: bool,
    tail: tuple[int, TailHashes | None],
) -> None:
    """A compact file: read and checksum it whole, then decode its planes into the targets.

    ``tail``: the first tail row the targets want, and the hashes of the tail rows.
    """
    assert opened.physical is not None and opened.planes is not None
    row, physical = opened.row, opened.physical
    data = scratch.get("data", row.stored_bytes - len(opened.header))
    whole, body = data.data, len(opened.header)
    skip = physical.get(DETACHED) if opened.detached is not None and not with_detached else None
    if skip is None:
        read_exactly(opened.fd, [whole], body)
    else:  # the detached tensor is not needed: its bytes are left unread (a hole in ``whole``)
        read_exactly(opened.fd, [whole[: skip.begin]], body)
        read_exactly(opened.fd, [whole[skip.end :]], body + skip.end)
    _check_compact(opened, whole, with_detached, tail[1])  # before anything is decoded or written

    def section(name: str) -> memoryview:
        spec = physical[name]
        return whole[spec.begin : spec.end]

    outputs = {name: [byte_view(arr)] for name, arr in own.items()}
    outputs.update(placed)
    for name, parts in outputs.items():
        if name in physical:  # stored whole: copied (a tail from its first wanted row)
            src = section(name)
            at = len(src) // opened.tail_rows * tail[0] if is_tail(name) else 0
            for part in parts:
                part[:] = src[at : at + len(part)]
                at += len(part)
    split = [name for name, _ in opened.planes]
    if q6.compiled():
        # straight to the compiled decoder: one call, no arrays made (_logical checked the parts)
        q6.decode_views(
            [
                (
                    section(name + planes.LO),
                    section(name + planes.Q6_INDEX),
                    section(name + planes.Q6_TABLE),
                    outputs[name],
                )
                for name in split
            ]
        )
        return
    stored = {name: np.frombuffer(section(name), dtype=np.uint8) for name in physical}
    planes.decode_planes(
        stored,
        opened.planes,
        {name: [np.frombuffer(v, dtype=np.uint8) for v in outputs[name]] for name in split},
    )
