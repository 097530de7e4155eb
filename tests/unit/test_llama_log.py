"""llama.cpp's log reaches Python as ``localkv.llama`` asks, filtered in C (``_quietlog``)."""

from __future__ import annotations

import ctypes
import logging

import pytest
from support.tinymodels import TinyModels, tiny_config

from localkv.model import native
from localkv.model.session import ModelSession


def test_llama_cpp_info_lines_reach_python_when_logged(
    tiny_models: TinyModels, caplog: pytest.LogCaptureFixture
) -> None:
    assert native._quietlog is not None  # setup.py builds it; `make test` installs that
    with (
        caplog.at_level(logging.DEBUG, logger="localkv.llama"),
        ModelSession(tiny_config(tiny_models.base)),
    ):
        pass
    loud = [r for r in caplog.records if r.name == "localkv.llama" and r.levelno == logging.DEBUG]
    assert len(loud) > 100  # llama.cpp describes the model it loads, line by line


def test_the_filter_passes_warnings_errors_and_their_continuations() -> None:
    quietlog = native._quietlog
    assert quietlog is not None
    seen: list[tuple[int, bytes]] = []

    def collect(level: int, text: bytes, user_data: object) -> None:
        seen.append((level, text))

    collector = native.llama_cpp.llama_log_callback(collect)
    lines = [(2, b"info"), (5, b"info goes on"), (3, b"warn"), (5, b"warn goes on"), (4, b"err")]
    lines += [(1, b"debug"), (0, b"none")]
    try:
        address = quietlog.install(ctypes.cast(collector, ctypes.c_void_p).value, False)
        filtered = native.llama_cpp.llama_log_callback(address)
        for level, text in lines:
            filtered(level, text, None)
        assert seen == [(3, b"warn"), (5, b"warn goes on"), (4, b"err")]
        seen.clear()
        quietlog.set_detail(True)
        for level, text in lines:
            filtered(level, text, None)
        assert seen == lines
    finally:
        quietlog.install(ctypes.cast(native._route_log, ctypes.c_void_p).value, False)
        native.sync_log_detail()
