"""The side panel: the model, the system prompt, attached documents, context used."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Label, ProgressBar, Static

from localkv.chat.controller import ContextInfo
from localkv.chat.formats import human_bytes
from localkv.runtime.info import LoadedModel
from localkv.runtime.reports import printable

__all__ = ["ContextPanel"]

_SYSTEM_CHARS = 160


class ContextPanel(VerticalScroll):
    def __init__(self, model: LoadedModel, context: ContextInfo, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.model_info = model
        self.context_info = context

    def compose(self) -> ComposeResult:
        yield Label("Model", classes="heading")
        yield Static(Content(_model_text(self.model_info)), id="model-info")
        yield Label("System prompt", classes="heading")
        yield Static(id="system-info")
        yield Label("Documents", classes="heading")
        yield Static(id="documents-info")
        yield Label("Context", classes="heading")
        yield ProgressBar(show_eta=False, id="context-bar")
        yield Static(id="context-info")
        yield Label("Cache", classes="heading")
        yield Static(id="cache-info")

    def on_mount(self) -> None:
        self.show_context(self.context_info)

    def show_context(self, context: ContextInfo) -> None:
        self.context_info = context
        system = context.system or "(none)"
        if len(system) > _SYSTEM_CHARS:
            system = system[: _SYSTEM_CHARS - 1] + "…"
        docs = "\n".join(f"{printable(name)} · {n:,} tok" for name, n in context.documents)
        docs = docs or "(none)"
        self.query_one("#system-info", Static).update(Content(system))
        self.query_one("#documents-info", Static).update(Content(docs))
        self.query_one("#context-bar", ProgressBar).update(
            total=context.total, progress=context.used
        )
        used = f"{context.used:,} / {context.total:,} tokens"
        self.query_one("#context-info", Static).update(Content(used))
        self.query_one("#cache-info", Static).update(Content(context.cache))


def _model_text(model: LoadedModel) -> str:
    gpu = f"{model.device} {model.n_gpu_layers} layers" if model.n_gpu_layers else "CPU only"
    return (
        f"{model.name}\n{model.description}\n{human_bytes(model.file_bytes)} · {gpu}\n"
        f"KV {model.type_k}/{model.type_v} · flash attn {model.flash_attn}"
    )
