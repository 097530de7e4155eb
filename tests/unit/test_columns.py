"""V rows into llama.cpp's columns (``localkv.kv.columns``): compiled and numpy agree."""

from __future__ import annotations

import numpy as np
import pytest

from localkv.kv import columns
from localkv.kv.columns import to_columns

COMPILED = pytest.mark.skipif(not columns.COMPILED, reason="the _columns extension is not built")


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
@pytest.mark.parametrize(
    ("n", "at", "t", "width"),
    [(300, 0, 256, 64), (1000, 37, 77, 13), (9, 1, 8, 8), (17, 16, 1, 1), (1300, 5, 600, 24)],
)
@pytest.mark.parametrize("compiled", [pytest.param(True, marks=COMPILED), False])
def test_rows_land_in_their_columns_only(
    dtype: type, n: int, at: int, t: int, width: int, compiled: bool
) -> None:
    rng = np.random.default_rng(n + t + width)
    rows = rng.integers(1, 200, size=(t, width)).astype(dtype)
    cols = np.zeros((width, n), dtype=dtype)
    to_columns(rows, cols, at, compiled=compiled)
    assert np.array_equal(cols[:, at : at + t], rows.T)
    assert not cols[:, :at].any() and not cols[:, at + t :].any()


@COMPILED
def test_compiled_equals_numpy_on_a_restore_sized_layer() -> None:
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 2**16, size=(2048, 192), dtype=np.uint16)
    ours, theirs = np.empty((192, 4096), np.uint16), np.empty((192, 4096), np.uint16)
    for start in range(0, 2048, 256):  # a block at a time, as a restore goes
        to_columns(rows[start : start + 256], ours, start)
        to_columns(rows[start : start + 256], theirs, start, compiled=False)
    assert np.array_equal(ours[:, :2048], theirs[:, :2048])
    assert np.array_equal(ours[:, :2048], rows.T)


def test_rows_that_do_not_fit_are_refused() -> None:
    cols = np.zeros((8, 100), np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        to_columns(np.zeros((10, 8), np.uint16), cols, 95)
    with pytest.raises(ValueError, match="do not fit"):
        to_columns(np.zeros((10, 7), np.uint16), cols)
    with pytest.raises(ValueError, match="do not fit"):
        to_columns(np.zeros((10, 8), np.uint32), cols)


@COMPILED
def test_the_extension_checks_its_own_bounds() -> None:
    from localkv.kv import _columns

    src = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="rows"):
        _columns.to_columns(src, np.zeros((4, 10), np.uint16), 5, 8, 4, 2)  # past the column
    with pytest.raises(ValueError, match="source"):
        _columns.to_columns(src, np.zeros((4, 100), np.uint16), 0, 16, 4, 2)  # 128 bytes needed
    with pytest.raises(ValueError, match="overlap"):
        _columns.to_columns(src, src, 0, 2, 2, 2)
