"""The chat's link to its saved history: one conversation's id and revision, each write checked.

A turn is written twice, each time in one transaction: the user's message
before the answer (as the conversation's ``pending`` message), then the answer
(complete, or as far as it got when stopped) with the message in the
conversation. A chat killed in between leaves the message saved; reopening
the conversation keeps it, with an empty answer.

Every write names the revision this chat last wrote or read. When another
chat wrote the same conversation meanwhile, this one's state is saved as a new
conversation (a fork) and a notice says so: nothing either chat said is lost.
A write that fails (disk full, read-only, I/O error) sets ``error`` — the
faces show it at once — and the next write tries again with the whole state.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from localkv.history.store import ConversationInfo, ConversationModel, ConversationStore
from localkv.runtime import Runtime
from localkv.runtime.chatsession import ChatState

__all__ = ["HistoryKeeper", "ModelMismatch", "check_model", "model_of"]

log = logging.getLogger(__name__)


class ModelMismatch(RuntimeError):
    """A saved conversation made with another model: its tokens mean nothing to this one."""


def model_of(runtime: Runtime) -> ConversationModel:
    """The model file's name, and its content hash and cache identity when the cache is on."""
    name = Path(runtime.session.config.model_path).name
    identity = runtime.cache.identity if runtime.cache is not None else None
    if identity is None:
        return ConversationModel(name)
    return ConversationModel(name, identity.model_sha256, identity.digest)


def check_model(info: ConversationInfo, model: ConversationModel) -> None:
    """Raise ``ModelMismatch`` naming the model ``info`` needs (rows without one pass)."""
    needed = info.model
    if needed is not None and needed.differs(model):
        raise ModelMismatch(
            f"“{info.title}” was made with the model {needed.describe()}, not {model.file}: "
            f"resume it with --model pointing at {needed.file}"
        )


class HistoryKeeper:
    """Writes one conversation at a time; holds its id, revision, the last error and notices."""

    def __init__(
        self,
        store: ConversationStore | None,
        model: ConversationModel,
        error: str | None,
        *,
        n_ctx: int | None = None,
    ) -> None:
        """``n_ctx``: the context the conversations are made in, saved with them."""
        self.store = store
        self.model = model
        self.n_ctx = n_ctx
        self.error = error if store is None else None
        self.id: str | None = None
        self.revision = 0
        self._notices = [f"conversation history: {r}" for r in (store.repairs if store else [])]

    def notices(self) -> list[str]:
        """What happened to the history since the last call (forks, skipped rows, repairs)."""
        out, self._notices = self._notices, []
        return out

    def note(self, text: str) -> None:
        self._notices.append(text)

    def started(self, info: ConversationInfo | None) -> None:
        """This chat now continues ``info`` (None: a new conversation, saved on its first turn)."""
        self.id = info.id if info is not None else None
        self.revision = info.revision if info is not None else 0

    def question(self, state: ChatState, text: str) -> None:
        """Save the user's message before it is answered (``state``: the turns before it)."""
        self._write(state, text)

    def answered(self, state: ChatState) -> None:
        """Save the turn with its answer (or the conversation as it is, no message pending)."""
        self._write(state, None)

    def _write(self, state: ChatState, pending: str | None) -> None:
        store = self.store
        if store is None:
            return
        if self.id is None and pending is None and all(m.role == "system" for m in state.messages):
            return  # nothing worth a row yet
        try:
            written = store.write(
                state, self.id, self.revision, model=self.model, pending=pending, n_ctx=self.n_ctx
            )
        except (sqlite3.Error, OSError, RuntimeError) as exc:
            log.warning("could not save the conversation: %s", exc)
            self.error = str(exc)
            return
        if self.error is not None:
            self.note("the conversation is saved again")
            self.error = None
        if written.forked_from is not None and self.id is not None:
            self.note(
                f"the saved conversation {self.id} changed elsewhere ({written.reason}): "
                f"this chat goes on as the new conversation {written.id}, forked from it; "
                "nothing is lost"
            )
        self.id, self.revision = written.id, written.revision
