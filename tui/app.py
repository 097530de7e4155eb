"""The chat app: a small App that shows the chat screen (or why the model did not load).

``build_app`` is the one factory, used by ``localkv chat`` and by the tests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar

from textual.app import App
from textual.binding import Binding, BindingType
from textual.logging import TextualHandler

from localkv import SamplingParams
from localkv.chat.controller import ChatController
from localkv.history.store import ConversationStore
from localkv.runtime import Runtime

from .chat_screen import ChatScreen
from .load_error_screen import LoadErrorScreen

__all__ = ["LocalKVApp", "build_app", "logs_to_textual", "run_app"]


class LocalKVApp(App[None]):
    TITLE = "localkv"
    CSS_PATH = "app.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(self, controller: ChatController | None, screen: ChatScreen | LoadErrorScreen):
        super().__init__()
        self.controller = controller
        self._first_screen = screen

    def on_mount(self) -> None:
        self.push_screen(self._first_screen)

    def close_controller(self) -> None:
        """Wait for the model's last request to end (before closing the runtime)."""
        if self.controller is not None:
            self.controller.close()


def build_app(  # noqa: PLR0913 - to take a value type
    runtime: Runtime | None,
    *,
    params: SamplingParams | None = None,
    history: ConversationStore | None = None,
    history_error: str | None = None,
    system: str | None = None,
    documents: Sequence[str] = (),
    resume: bool = False,
    load_error: str | None = None,
) -> LocalKVApp:
    """The chat app on ``runtime``; without one, it shows ``load_error``.

    The caller owns ``runtime`` and ``history``; after ``run()`` returns, call
    ``app.close_controller()`` and then close them.
    """
    if runtime is None:
        return LocalKVApp(None, LoadErrorScreen(load_error or "no model"))
    controller = ChatController(runtime, history, system=system, history_error=history_error)
    notice = controller.template_notice()  # logged before the app covered the terminal
    if notice is not None:
        controller.keeper.note(notice)
    screen = ChatScreen(
        controller,
        params or SamplingParams(),
        system=system,
        documents=documents,
        resume=resume,
    )
    return LocalKVApp(controller, screen)


def run_app(app: LocalKVApp) -> int:
    """Run the app in this terminal; the exit code (1 when the model did not load).

    The caller closes the runtime and the history afterwards.
    """
    with logs_to_textual():
        app.run()
    app.close_controller()
    return 1 if app.controller is None else app.return_code or 0


@contextmanager
def logs_to_textual() -> Iterator[None]:
    """Send log records to Textual's log while the app owns the terminal."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [TextualHandler()]
    try:
        yield
    finally:
        root.handlers = saved
