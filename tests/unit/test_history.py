"""Saved conversations: the schema, exact round trips, ordering, privacy on disk."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import sqlite_utils

from localkv.chat.history import (
    HISTORY_FILE,
    MIGRATIONS,
    ConversationNotFound,
    ConversationStore,
    migrate,
    title_of,
)
from localkv.chat.session import ChatState
from localkv.prompt.template import Message

EXPECTED = {
    "id": str,
    "title": str,
    "system": str,
    "messages": str,
    "tokens": bytes,
    "boundaries": str,
    "documents": str,
    "n_messages": int,
    "n_tokens": int,
    "created": float,
    "updated": float,
    "generated": str,
}


def _state(question: str = "What is due on Friday?") -> ChatState:
    return ChatState(
        system="Answer from the notes.",
        messages=[
            Message("system", "Answer from the notes."),
            Message("user", "NOTES\nThe report is due on Friday."),
            Message("user", question),
            Message("assistant", "The report — ünïcode ✓."),
        ],
        tokens=[1, 9, 49151, 0, 2**31 - 1, 77, 5],
        boundaries=[2, 4, 7],
        documents=[("notes.txt", 2)],
        generated=[(4, 6)],
    )


def test_migrations_build_the_schema_and_are_recorded() -> None:
    db = sqlite_utils.Database(memory=True)
    assert migrate(db) == [fn.__name__ for fn in MIGRATIONS]
    assert db["conversations"].columns_dict == EXPECTED
    assert [r["name"] for r in db["_migrations"].rows] == [fn.__name__ for fn in MIGRATIONS]
    assert migrate(db) == []  # applied once


def test_a_state_round_trips_exactly() -> None:
    with ConversationStore(None) as store:
        state = _state()
        conv_id = store.save(state)
        assert store.load(conv_id) == state
        info = store.info(conv_id)
        assert (info.title, info.messages, info.tokens) == ("What is due on Friday?", 4, 7)


def test_save_with_an_id_updates_in_place_and_lists_newest_first() -> None:
    with ConversationStore(None) as store:
        first = store.save(_state("First?"))
        second = store.save(_state("Second?"))
        assert [c.id for c in store.list()] == [second, first]
        created = store.info(first).created
        longer = _state("First?")
        longer.messages.append(Message("user", "And then?"))
        assert store.save(longer, first) == first
        assert [c.id for c in store.list()] == [first, second]
        latest = store.latest()
        assert latest is not None and latest.id == first and latest.messages == 5
        assert store.info(first).created == created
        assert len(store.list()) == 2


def test_delete_and_missing_conversations() -> None:
    with ConversationStore(None) as store:
        assert store.latest() is None
        conv_id = store.save(_state())
        assert store.delete(conv_id)
        assert not store.delete(conv_id)
        with pytest.raises(ConversationNotFound):
            store.load(conv_id)
        with pytest.raises(ConversationNotFound):
            store.info(conv_id)
        assert store.list() == []


def test_titles() -> None:
    assert title_of(_state("  What is\n due?  ")) == "What is due?"
    assert len(title_of(_state("x" * 200))) == 60
    docs_only = ChatState(messages=[Message("user", "text")], documents=[("a.txt", 3)])
    assert title_of(docs_only) == "a.txt"
    assert title_of(ChatState()) == "(new conversation)"


def test_the_file_lives_in_the_cache_root_and_is_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALKV_HOME", str(home))
    old = os.umask(0o022)
    try:
        with ConversationStore.open() as store:
            store.save(_state())
    finally:
        os.umask(old)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    files = [p for p in home.iterdir() if p.name.startswith(HISTORY_FILE)]
    assert home / HISTORY_FILE in files
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_two_stores_share_one_file(tmp_path: Path) -> None:
    with ConversationStore.open(tmp_path) as a, ConversationStore.open(tmp_path) as b:
        first = a.save(_state("From a?"))
        second = b.save(_state("From b?"))
        assert {c.id for c in a.list()} == {first, second}
        assert b.load(first) == a.load(first)
        journal = a.db.execute("PRAGMA journal_mode").fetchone()[0]
        assert journal == "wal"


def test_a_closed_store_refuses_work_and_closes_twice() -> None:
    store = ConversationStore(None)
    store.close()
    store.close()
    with pytest.raises(RuntimeError):
        store.list()
