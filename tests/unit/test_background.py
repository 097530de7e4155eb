"""Cache bookkeeping kept back while a restore leads to its first token."""

from __future__ import annotations

import threading

from localkv.cache.background import BackgroundWork, first_then


def test_bookkeeping_held_runs_at_release_in_order() -> None:
    work, ran = BackgroundWork(), []
    try:
        work.defer(lambda: ran.append("before"))
        work.wait()
        release = work.hold()
        work.defer(lambda: ran.append("held 1"))
        work.defer(lambda: ran.append("held 2"))
        work.wait()  # a wait (a restore waits for saves) does not release the hold
        assert ran == ["before"]
        release()
        work.wait()
        assert ran == ["before", "held 1", "held 2"]
        release()  # a second release queues nothing again
        work.defer(lambda: ran.append("after"))
        work.wait()
        assert ran == ["before", "held 1", "held 2", "after"]
    finally:
        work.close()


def test_close_runs_what_a_hold_kept_back() -> None:
    work, ran = BackgroundWork(), threading.Event()
    work.hold()
    work.defer(ran.set)
    assert not ran.is_set()
    work.close()  # an answer that raised before its release: nothing is lost
    assert ran.is_set()


def test_first_then_calls_once_after_the_first_text_went_out() -> None:
    seen: list[str] = []
    calls: list[int] = []
    send = first_then(seen.append, lambda: calls.append(len(seen)))
    for piece in ["", "a", "b"]:
        send(piece)
    assert seen == ["", "a", "b"]
    assert calls == [2]  # after "a" (the empty piece is not text) was handed on, once
    quiet = first_then(None, lambda: calls.append(-1))
    quiet("x")
    assert calls == [2, -1]
