"""A restart's restore, step by step, as the server reports it in the ``localkv`` object.

A real ``localkv serve`` on the tiny model answers a long system prompt, stops,
and a fresh one over the same cache answers it again from disk: streamed through
OpenAI's chat completions, whole through Anthropic's Messages. Each answer from
disk names the restore's steps (``restore_steps``, milliseconds) and the prompt's
building (``prompt_ms``); an answer from the live context or from no cache names
no step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from support.server import ServerProcess
from support.tinymodels import TinyModels

STEPS = ("lookup", "read", "load", "probe")  # one after another; ``columns`` is part of read


def _args(tiny_models: TinyModels) -> list[str]:
    return ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "2048"]


def _openai(proc: ServerProcess, system: str, *, stream: bool) -> dict[str, Any]:
    """The ``localkv`` object of an OpenAI chat completion, streamed or whole."""
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Sum."}],
        "temperature": 0,
        "max_tokens": 4,
        "stream": stream,
    }
    url = proc.base_url + "/v1/chat/completions"
    if not stream:
        reply = httpx.post(url, json=body, timeout=300)
        reply.raise_for_status()
        return reply.json()["localkv"]  # type: ignore[no-any-return]
    found: dict[str, Any] = {}
    with httpx.stream("POST", url, json=body, timeout=300) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                found = json.loads(line[len("data: ") :]).get("localkv") or found
    return found


def _anthropic(proc: ServerProcess, system: str) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "system": system,
        "messages": [{"role": "user", "content": "Sum."}],
        "temperature": 0,
        "max_tokens": 4,
    }
    reply = httpx.post(proc.base_url + "/v1/messages", json=body, timeout=300)
    reply.raise_for_status()
    return reply.json()["localkv"]  # type: ignore[no-any-return]


def _check_steps(kv: dict[str, Any]) -> None:
    assert kv["source"] == "disk" and kv["verified"] is True, kv
    steps = kv["restore_steps"]
    assert set(STEPS) <= set(steps) <= {*STEPS, "columns"}, steps
    assert all(steps[name] > 0 for name in STEPS), steps
    assert steps.get("columns", 0.0) >= 0
    # the steps follow one another within the restore: each value is rounded to 0.001 ms
    assert sum(steps[name] for name in STEPS) <= kv["restore_ms"] + 0.003, kv
    assert 0 < kv["prompt_ms"] <= kv["ttft_ms"]


def test_an_answer_from_disk_names_the_restores_steps_and_no_other_does(
    tmp_path: Path, tiny_models: TinyModels, long_text: str
) -> None:
    system = long_text[:6000]
    log = tmp_path / "server.log"
    with ServerProcess(_args(tiny_models), log) as proc:
        first = _openai(proc, system, stream=False)  # computed: nothing to restore
        again = _openai(proc, system, stream=True)  # the live context
    assert first["source"] == "none" and again["source"] == "live"
    assert "restore_steps" not in first and "restore_steps" not in again
    assert first["prompt_ms"] > 0 and again["prompt_ms"] > 0
    with ServerProcess(_args(tiny_models), log) as proc:
        streamed = _openai(proc, system, stream=True)
    _check_steps(streamed)
    with ServerProcess(_args(tiny_models), log) as proc:
        whole = _anthropic(proc, system)
    _check_steps(whole)
