"""Ollama's response shapes: the model's card, answers, NDJSON stream lines."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from localkv.server.errors import ApiError
from localkv.server.requests import ModelFacts, Outcome

__all__ = ["Answer", "model_card", "ndjson", "now", "show"]

# llama.cpp's ``general.file_type`` values, as Ollama names them
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 28: "IQ4_XS", 32: "BF16",
}  # fmt: skip


def now() -> str:
    """The time as Ollama writes it (RFC 3339, UTC)."""
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def ndjson(data: dict[str, object]) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n"


def model_card(facts: ModelFacts) -> dict[str, Any]:
    """The loaded model as ``/api/tags`` lists it: name, size, digest, details."""
    meta = facts.metadata
    family = meta.get("general.architecture", "")
    file_type = meta.get("general.file_type")
    quant = FILE_TYPES.get(int(file_type), file_type) if file_type else ""
    return {
        "name": facts.model_id,
        "model": facts.model_id,
        "modified_at": dt.datetime.fromtimestamp(facts.modified, dt.UTC).isoformat(),
        "size": facts.size,
        "digest": facts.digest,
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": family,
            "families": [family] if family else None,
            "parameter_size": meta.get("general.size_label") or _size_label(facts.n_params),
            "quantization_level": quant or "",
        },
    }


def _size_label(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def model_info(facts: ModelFacts) -> dict[str, Any]:
    """``/api/show``'s ``model_info``: the GGUF metadata llama.cpp reports."""
    info: dict[str, Any] = {
        key: int(value) if value.isdigit() else value for key, value in facts.metadata.items()
    }
    info["general.parameter_count"] = facts.n_params
    return info


def show(facts: ModelFacts) -> dict[str, Any]:
    card = model_card(facts)
    params = "\n".join(f"{k} {v}" for k, v in (("temperature", 0.8), ("top_k", 40), ("top_p", 0.9)))
    return {
        "modelfile": f"FROM {facts.path}\n",
        "parameters": params,
        "template": facts.template,
        "details": card["details"],
        "model_info": model_info(facts),
        "capabilities": ["completion", "tools"],
        "modified_at": card["modified_at"],
    }


@dataclass(frozen=True, slots=True)
class Answer:
    """One Ollama answer: ``/api/chat`` (a message) or ``/api/generate`` (a response); the
    gateway's encoder, a stream being NDJSON lines (no keep-alive: a line is an answer's)."""

    media_type: ClassVar[str] = "application/x-ndjson"
    keepalive: ClassVar[str] = ""

    model: str
    chat: bool

    def part(self, text: str = "", thinking: str | None = None) -> dict[str, object]:
        out: dict[str, object] = {"model": self.model, "created_at": now()}
        if self.chat:
            message: dict[str, object] = {"role": "assistant", "content": text}
            if thinking is not None:
                message["thinking"] = thinking
            out["message"] = message
        else:
            out["response"] = text
            if thinking is not None:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def final(self, outcome: Outcome, whole: bool) -> dict[str, object]:
        """The last line (``whole``: the whole answer, not streamed), with the counts."""
        text = outcome.text if whole else ""
        out = self.part(text, outcome.reasoning if whole else None)
        if self.chat and outcome.tool_calls:
            message = out["message"]
            assert isinstance(message, dict)
            message["tool_calls"] = [
                {"function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in outcome.tool_calls
            ]
        prompt_ns = int(outcome.ttft_s * 1e9)
        out.update(
            done=True,
            done_reason="length" if outcome.finish_reason == "length" else "stop",
            total_duration=int((outcome.queued_s + outcome.total_s) * 1e9),
            load_duration=0,
            prompt_eval_count=outcome.prompt_tokens,
            prompt_eval_duration=prompt_ns,
            prompt_eval_cached_count=outcome.cached_tokens,
            eval_count=outcome.generated,
            eval_duration=max(0, int(outcome.total_s * 1e9) - prompt_ns),
            localkv=outcome.localkv(),
        )
        return out

    # the gateway's encoder
    def whole(self, outcome: Outcome) -> dict[str, object]:
        return self.final(outcome, whole=True)

    def opening(self) -> str:
        return ""

    def piece(self, kind: str, text: str) -> str:
        return ndjson(self.part("", thinking=text) if kind == "reasoning" else self.part(text))

    def closing(self, outcome: Outcome) -> str:
        return ndjson(self.final(outcome, whole=False))

    def failure(self, error: ApiError) -> str:
        return ndjson({"error": error.message})


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text
