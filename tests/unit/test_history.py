"""Saved conversations: the schema, round trips, revisions and forks, damaged rows, full disks."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import sqlite_utils

from localkv.chat.saving import HistoryKeeper
from localkv.history.rows import encode_state
from localkv.history.store import (
    HISTORY_FILE,
    MIGRATIONS,
    ConversationModel,
    ConversationNotFound,
    ConversationStore,
    MalformedConversation,
    Skipped,
    Written,
    migrate,
    title_of,
)
from localkv.prompt.template import Message
from localkv.runtime.chatsession import ChatState

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
    "model": str,
    "model_sha256": str,
    "identity": str,
    "pending": str,
    "forked_from": str,
    "revision": int,
    "n_ctx": int,
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


# ------------------------------------------------------------ models, revisions, damage
MODEL = ConversationModel("tiny-base.gguf", "ab" * 32, "lkv-id1:cd")


def test_rows_saved_before_models_were_recorded_migrate_and_still_load(tmp_path: Path) -> None:
    path = tmp_path / HISTORY_FILE
    db = sqlite_utils.Database(path)
    old = MIGRATIONS[:2]  # the schema as m001 and m002 left it
    db.table("_migrations").create({"name": str, "applied_at": float}, pk="name")
    for fn in old:
        fn(db)
        db.table("_migrations").insert({"name": fn.__name__, "applied_at": 0.0})
    state = _state()
    db.table("conversations").insert(
        {"id": "old", "title": "Old", "created": 1.0, "updated": 2.0, **encode_state(state)}
    )
    db.close()
    with ConversationStore(path) as store:
        info = store.info("old")
        assert (info.model, info.revision, info.pending) == (None, 0, None)
        assert store.load("old") == state
        written = store.write(state, "old", 0, model=MODEL)
        assert written == Written(id="old", revision=1) and store.info("old").model == MODEL


def test_a_write_at_a_stale_revision_forks_and_loses_nothing(tmp_path: Path) -> None:
    with ConversationStore.open(tmp_path) as a, ConversationStore.open(tmp_path) as b:
        first = a.write(_state("Shared?"), None, 0, model=MODEL)
        assert (first.revision, first.forked_from) == (1, None)
        mine = a.write(_state("From a?"), first.id, first.revision, model=MODEL)
        assert mine == Written(id=first.id, revision=2)
        theirs = b.write(_state("From b?"), first.id, first.revision, model=MODEL)
        assert theirs.forked_from == first.id and theirs.id != first.id
        assert theirs.reason == "another chat saved it meanwhile"
        assert title_of(a.load(first.id)) == "From a?"
        assert title_of(a.load(theirs.id)) == "From b?"
        assert a.info(theirs.id).forked_from == first.id
        assert a.delete(first.id)
        gone = b.write(_state("Again?"), first.id, 2, model=MODEL)
        assert gone.forked_from == first.id and gone.reason == "it was deleted meanwhile"


def test_the_message_awaiting_its_answer_is_saved_with_the_turns_before_it() -> None:
    with ConversationStore(None) as store:
        before = ChatState(system="Be brief.", messages=[Message("system", "Be brief.")])
        written = store.write(before, None, 0, model=None, pending="What is due?")
        info = store.info(written.id)
        assert (info.pending, info.title, info.model) == ("What is due?", "What is due?", None)
        assert store.load(written.id) == before
        store.write(_state(), written.id, written.revision, model=MODEL)
        assert store.info(written.id).pending is None


@pytest.mark.parametrize(
    ("column", "value", "reason"),
    [
        ("messages", "{not json", "messages are not a JSON list"),
        ("messages", '[["robot", "NOTES secret"]]', "a message is not [role, text]"),
        ("tokens", b"\x01\x02\x03", "a tokens blob of 3 bytes is not int32 ids"),
        ("tokens", b"\x01\x00\x00\x00", "1 tokens, not 7"),
        ("tokens", b"\xff" * 28, "a negative token id"),
        ("boundaries", "[99]", "a boundary is outside"),
        ("generated", "[[5, 2]]", "a generated span is outside"),
        ("title", b"\x00", "the title is not text"),
    ],
)
def test_damaged_rows_are_skipped_and_reported_never_raised(
    column: str, value: object, reason: str
) -> None:
    with ConversationStore(None) as store:
        good = store.save(_state("Fine?"))
        bad = store.save(_state("NOTES damaged?"))
        store.db.conn.execute(f"UPDATE conversations SET {column} = ? WHERE id = ?", [value, bad])
        found, skipped = store.scan()
        assert [c.id for c in found] == [good] and skipped == [Skipped(bad, reason)]
        assert store.latest() is not None and store.latest().id == good  # type: ignore[union-attr]
        with pytest.raises(MalformedConversation, match=reason.replace("[", r"\[")):
            if column == "title":
                store.info(bad)
            else:
                store.load(bad)
        # cache forget still finds what a damaged row holds
        needle = "NOTES damaged?"
        if column == "messages":
            needle = "not json" if "not json" in str(value) else "NOTES secret"
        assert [c.id for c in store.holding(needle)] == [bad]


def test_a_dropped_table_is_made_again_and_reported(tmp_path: Path) -> None:
    with ConversationStore.open(tmp_path) as store:
        store.save(_state())
        store.db.execute("DROP TABLE conversations")
    with ConversationStore.open(tmp_path) as store:
        assert store.repairs == ["its conversations table was missing; made a new one"]
        assert store.list() == []
        store.save(_state())
    with ConversationStore.open(tmp_path) as store:
        assert store.repairs == [] and len(store.list()) == 1


@pytest.mark.parametrize("kind", ["garbage", "directory", "fifo", "symlink"])
def test_a_file_that_is_no_history_is_refused_at_open(tmp_path: Path, kind: str) -> None:
    path = tmp_path / HISTORY_FILE
    if kind == "garbage":
        path.write_bytes(b"\x00garbage" * 512)
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(tmp_path / "elsewhere.db")
    with pytest.raises(OSError, match=r"conversations\.db"):
        ConversationStore.open(tmp_path)


def test_ids_and_their_unique_starts_are_accepted() -> None:
    with ConversationStore(None) as store:
        a = store.save(_state(), "abc123")
        store.save(_state(), "abd456")
        assert store.resolve(a) == a and store.resolve("abc") == a
        for bad, message in [
            ("ab", "ambiguous: 2"),
            ("zz", "no saved conversation zz"),
            ("", "''"),
        ]:
            with pytest.raises(ConversationNotFound, match=message):
                store.resolve(bad)


def test_a_full_disk_is_an_error_then_the_next_write_saves_everything(tmp_path: Path) -> None:
    with ConversationStore.open(tmp_path) as store:
        keeper = HistoryKeeper(store, MODEL, None)
        keeper.answered(_state())
        pages = store.db.execute("PRAGMA page_count").fetchone()[0]
        store.db.execute(f"PRAGMA max_page_count = {pages}")
        big = _state("A long one?")
        big.tokens = list(range(100_000))
        keeper.question(big, "And now?")
        assert keeper.error is not None and "full" in keeper.error
        assert store.info(keeper.id or "").pending is None  # the failed write changed nothing
        store.db.execute("PRAGMA max_page_count = 1073741823")
        keeper.question(big, "And now?")
        assert keeper.error is None and keeper.notices() == ["the conversation is saved again"]
        assert store.info(keeper.id or "").pending == "And now?"
        assert store.load(keeper.id or "").tokens == big.tokens


def test_models_and_titles() -> None:
    assert MODEL.differs(ConversationModel("tiny-base.gguf", "ff" * 32))
    assert not MODEL.differs(ConversationModel("renamed.gguf", "ab" * 32))
    assert MODEL.differs(ConversationModel("other.gguf")) and not MODEL.differs(
        ConversationModel("tiny-base.gguf")
    )
    assert MODEL.describe() == "tiny-base.gguf (sha256 abababababab…)"
    assert title_of(ChatState(), "  Unanswered\n question ") == "Unanswered question"
