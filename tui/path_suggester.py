"""Completes ``/attach PATH`` from the file system."""

from __future__ import annotations

import os
from pathlib import Path

from textual.suggester import Suggester

__all__ = ["PathSuggester"]

PREFIX = "/attach "


class PathSuggester(Suggester):
    """Suggests the first entry (in name order) that extends the typed path.

    Directories get a trailing separator so completion can go on inside them.
    """

    def __init__(self, cwd: Path | None = None) -> None:
        super().__init__(use_cache=False, case_sensitive=True)
        self.cwd = cwd

    async def get_suggestion(self, value: str) -> str | None:
        if not value.startswith(PREFIX) or "\n" in value:
            return None
        typed = value[len(PREFIX) :]
        head, sep, partial = typed.rpartition(os.sep)
        base = Path(os.path.expanduser(head + sep) if sep else ".")
        if not base.is_absolute() and self.cwd is not None:
            base = self.cwd / base
        try:
            names = sorted(e.name for e in os.scandir(base) if e.name.startswith(partial))
        except OSError:
            return None
        for name in names:
            if name.startswith(".") and not partial.startswith("."):
                continue
            if name == partial and not (base / name).is_dir():
                continue
            tail = os.sep if (base / name).is_dir() else ""
            completed = value + name[len(partial) :] + tail
            if completed != value:
                return completed
        return None
