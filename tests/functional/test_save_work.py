"""Saving does no work that is not needed: a repeat captures no state.

A request whose blocks are all stored (the same document asked again) reads
nothing of the state after its answer; a request with new tokens captures it
once, however many blocks it adds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from support.tinymodels import TinyModels, tiny_config

from localkv.model.sampling import SamplingParams
from localkv.model.state import STATE_WORK
from localkv.prompt.request import Document
from localkv.runtime import Runtime

TEXT = "Alice was beginning to get very tired of sitting by her sister on the bank. "


def _counting(rt: Runtime) -> Callable[[], tuple[int, int]]:
    """State captures from now on, and their bytes (``STATE_WORK``: a capture of the
    whole state, or of the positions from the first block not stored on)."""
    captures, captured = STATE_WORK.captures, STATE_WORK.captured_bytes
    return lambda: (STATE_WORK.captures - captures, STATE_WORK.captured_bytes - captured)


@pytest.mark.parametrize("question", ["What?", "Who is by the bank?"])
def test_a_repeat_captures_no_state_and_new_tokens_one(
    question: str, tiny_models: TinyModels, tmp_path: Path
) -> None:
    doc = Document.from_text(" ".join(f"Chapter {i}. {TEXT}" for i in range(40)), "d.txt")
    params = SamplingParams(temperature=0, max_tokens=4)
    with Runtime(tiny_config(tiny_models.base, n_ctx=4096), cache_dir=tmp_path) as rt:
        calls = _counting(rt)
        rt.ask([doc], "What?", params=params)
        rt.wait_for_saves()
        assert calls()[0] == 1  # the first ask: blocks to save, one capture
        whole = len(rt.session.capture_state())
        calls = _counting(rt)
        rt.ask([doc], question, params=params)
        rt.wait_for_saves()
    if question == "What?":
        assert calls() == (0, 0)
    else:  # one capture, of the rows from the block the new question starts on
        captures, captured = calls()
        assert captures == 1 and 0 < captured < whole // 2


def test_a_repeat_before_the_first_save_is_written_captures_nothing(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    """The first answer's blocks are still queued for writing: the repeat does not
    capture them again, and they are on disk once the queue is done."""
    doc = Document.from_text(" ".join(f"Chapter {i}. {TEXT}" for i in range(40)), "d.txt")
    params = SamplingParams(temperature=0, max_tokens=4)
    with Runtime(tiny_config(tiny_models.base, n_ctx=4096), cache_dir=tmp_path) as rt:
        calls = _counting(rt)
        first = rt.ask([doc], "What?", params=params)
        rt.ask([doc], "What?", params=params)  # no wait_for_saves in between
        assert calls()[0] == 1
        rt.wait_for_saves()
    with Runtime(tiny_config(tiny_models.base, n_ctx=4096), cache_dir=tmp_path) as rt:
        again = rt.ask([doc], "What?", params=params)
    assert again.cache.verified and again.tokens.reused == first.tokens.prompt
    assert again.text == first.text
