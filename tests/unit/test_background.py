"""Cache bookkeeping kept back while a restore's answer is computed."""

from __future__ import annotations

import pytest

from localkv.cache.background import BackgroundWork


def test_bookkeeping_held_runs_at_the_end_of_the_block_in_order() -> None:
    work, ran = BackgroundWork(), []
    try:
        work.defer(lambda: ran.append("before"))
        work.wait()
        with work.held():
            work.defer(lambda: ran.append("held 1"))
            with work.held():  # inside another: the outer one queues it
                work.defer(lambda: ran.append("held 2"))
            work.wait()  # a wait (a restore waits for saves) does not release the hold
            assert ran == ["before"]
        work.wait()
        assert ran == ["before", "held 1", "held 2"]
        work.defer(lambda: ran.append("after"))
        work.wait()
        assert ran == ["before", "held 1", "held 2", "after"]
    finally:
        work.close()


def test_an_answer_that_fails_still_queues_its_bookkeeping() -> None:
    work, ran = BackgroundWork(), []
    try:
        with pytest.raises(RuntimeError), work.held():
            work.defer(lambda: ran.append("hit"))
            raise RuntimeError("the answer failed")
        work.wait()
        assert ran == ["hit"]
    finally:
        work.close()
