"""Parsed headers of recently read block files, kept between restores (``readinto``)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ..values import BlockRow
from .blockcodec import TensorSpec

__all__ = ["Compact", "HeaderCache"]

# a compact file's split tensors (in order, with dtypes) and its tensors as the block holds them
Compact = tuple[list[tuple[str, np.dtype[np.generic]]], dict[str, TensorSpec]]


class HeaderCache:
    """Parsed headers of recently read block files, so a repeated restore skips the JSON.

    An entry is used only if the file's header bytes, read again every time,
    are identical to the ones it was parsed from (and the checksum covers them).
    It holds the parse only: the metadata is checked against the row every time.
    """

    def __init__(self, max_entries: int = 1024) -> None:
        self._max = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[bytes, dict[str, str], dict[str, TensorSpec]]] = (
            OrderedDict()
        )
        self._compact: dict[str, Compact] = {}  # a compact file's parsed ``planes``, by checksum

    def get(
        self, row: BlockRow, header: bytes
    ) -> tuple[dict[str, str], dict[str, TensorSpec]] | None:
        with self._lock:
            entry = self._entries.get(row.checksum)
            if entry is None or entry[0] != header:
                return None
            self._entries.move_to_end(row.checksum)
            return entry[1], entry[2]

    def compact(self, row: BlockRow, header: bytes) -> Compact | None:
        """What ``put_compact`` recorded for this file's header (None if unknown)."""
        with self._lock:
            entry = self._entries.get(row.checksum)
            if entry is None or entry[0] != header:
                return None
            return self._compact.get(row.checksum)

    def put_compact(self, row: BlockRow, header: bytes, parsed: Compact) -> None:
        with self._lock:
            entry = self._entries.get(row.checksum)
            if entry is not None and entry[0] == header:
                self._compact[row.checksum] = parsed

    def size_of(self, row: BlockRow) -> int | None:
        """The header length of this row's file when last read (None if unknown)."""
        with self._lock:
            entry = self._entries.get(row.checksum)
        return None if entry is None else len(entry[0])

    def put(
        self, row: BlockRow, header: bytes, meta: dict[str, str], specs: dict[str, TensorSpec]
    ) -> None:
        with self._lock:
            self._entries[row.checksum] = (header, meta, specs)
            self._entries.move_to_end(row.checksum)
            self._compact.pop(row.checksum, None)
            while len(self._entries) > self._max:
                self._compact.pop(self._entries.popitem(last=False)[0], None)
