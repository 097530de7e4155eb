"""Sampling through llama.cpp's sampler chain answers the same from the cache as without it.

In every face (the Python API, ``ask``, the line-mode chat, the server), a
prompt restored from the disk cache and the same prompt computed with
``--no-cache`` give the same answer, greedy and with a seed. The repeat
penalty reads the prompt's last tokens on both paths; a grammar reads the
sampled ones. Each test also shows that what it compares could differ (another
seed draws another answer), so an equality is not vacuous.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from support.server import ServerProcess
from support.tinymodels import TinyModels, tiny_config

from localkv.model.sampling import SamplingParams
from localkv.prompt.request import Document
from localkv.runtime import Runtime

WAIT_S = 600  # liveness only
SYSTEM = "Answer from the document."
QUESTION = "What was Alice doing?"
TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of "
    "having nothing to do: once or twice she had peeped into the book her sister was reading. "
)
DOC = " ".join(f"Chapter {i}. {TEXT}" for i in range(24))  # about 900 tokens: 3 blocks
# seeded over the whole vocabulary: at the default top-k/top-p/min-p a random model's
# answers can be newlines whatever the seed, which would not show a seed's effect
SEEDED = ("--temperature", "1", "--seed", "5", "--top-k", "0", "--top-p", "1", "--min-p", "0")
GREEDY = ("--temperature", "0")
# a random model's chat answers are newlines at the default top-k/top-p/min-p: draw wider
WIDE = ("--temperature", "1.5", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--seed", "5")


def _params(seed: int | None, **extra: Any) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0, max_tokens=24, **extra)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=24, **extra)


@pytest.mark.parametrize(
    "params",
    [
        _params(None),
        _params(5, top_k=0, top_p=1.0, min_p=0.0),
        _params(5, repeat_penalty=1.5, repeat_last_n=256),
        _params(5, grammar='root ::= [a-z ,.]+ "."'),
    ],
    ids=["greedy", "seeded", "seeded-penalty-256", "seeded-grammar"],
)
def test_the_api_answers_from_the_cache_as_without_it(
    tiny_models: TinyModels, tmp_path: Path, params: SamplingParams
) -> None:
    doc = Document.from_text(DOC, "doc.txt")
    config = tiny_config(tiny_models.base, n_ctx=2048)
    with Runtime(config, cache_dir=tmp_path) as rt:
        rt.prefill([doc], system=SYSTEM)
        rt.wait_for_saves()
        rt.session.reset()  # nothing live: the prompt comes from the disk
        cached = rt.ask([doc], QUESTION, system=SYSTEM, params=params)
    with Runtime(config, use_cache=False) as rt:
        uncached = rt.ask([doc], QUESTION, system=SYSTEM, params=params)
        if params.seed is not None:
            other = SamplingParams(**{**_fields(params), "seed": params.seed + 1})
            assert rt.ask([doc], QUESTION, system=SYSTEM, params=other).text != uncached.text
    assert cached.cache.verified is True and cached.tokens.reused > 512
    assert uncached.tokens.reused == 0 and uncached.tokens.generated > 0
    assert cached.text == uncached.text and cached.tokens.generated == uncached.tokens.generated


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def _localkv(home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LOCALKV_HOME": str(home)}
    env.pop("LOCALKV_MODEL", None)
    done = subprocess.run(
        [sys.executable, "-m", "localkv", *args],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert done.returncode == 0, done.stderr
    return done


def _model(tiny_models: TinyModels) -> list[str]:
    return ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "2048"]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_ask_answers_from_the_cache_as_with_no_cache(
    tiny_models: TinyModels, tmp_path: Path, sampling: tuple[str, ...]
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    ask = ["ask", *_model(tiny_models), "--system", SYSTEM, "--max-tokens", "24", "--json"]
    _localkv(tmp_path, "prefill", *_model(tiny_models), "--system", SYSTEM, str(doc))

    def answer(*extra: str) -> dict[str, Any]:
        out = _localkv(tmp_path, *ask, *sampling, *extra, str(doc), QUESTION).stdout
        return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]

    cached, uncached = answer(), answer("--no-cache")
    assert cached["cache"]["verified"] is True and cached["tokens"]["reused"] > 512
    assert uncached["tokens"]["reused"] == 0
    assert cached["answer"] == uncached["answer"] and cached["tokens"]["generated"] == 24
    if sampling == SEEDED:
        assert answer("--seed", "6", "--no-cache")["answer"] != uncached["answer"]


def test_a_resumed_chat_answers_from_the_cache_as_with_no_cache(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    chat = ["chat", "--plain", *_model(tiny_models), "--max-tokens", "24", *WIDE]
    _localkv(tmp_path, *chat, "--system", SYSTEM + " " + DOC, stdin="Who is Alice?\n/quit\n")
    question = "And what did she do next?\n/quit\n"
    pristine = tmp_path.parent / f"{tmp_path.name}-pristine"
    shutil.copytree(tmp_path, pristine)  # a resume continues the conversation: keep this one

    def resume(*extra: str) -> subprocess.CompletedProcess[str]:
        home = pristine.parent / f"{pristine.name}-{len(extra)}-{'-'.join(extra)}"
        shutil.copytree(pristine, home)
        return _localkv(home, *chat, "--resume", *extra, stdin=question)

    resumed = _localkv(tmp_path, *chat, "--resume", stdin=question)
    restored = re.search(r"restored ([\d,]+) tokens \(verified\)", resumed.stderr)
    assert restored is not None, resumed.stderr
    assert int(restored.group(1).replace(",", "")) > 512
    uncached = resume("--no-cache")
    assert "cache disabled" in uncached.stderr
    assert resumed.stdout.strip() and resumed.stdout == uncached.stdout
    assert resume("--no-cache", "--seed", "6").stdout != uncached.stdout


def test_the_server_answers_from_the_disk_as_with_no_cache(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    messages = [
        {"role": "system", "content": SYSTEM + " " + DOC},
        {"role": "user", "content": "Hi"},
    ]
    bodies = [
        {"temperature": 0, "max_tokens": 24},
        {"temperature": 1, "seed": 5, "max_tokens": 24},
        {"temperature": 1, "seed": 5, "max_tokens": 24, "response_format": {"type": "json_object"}},
    ]

    def answers(*extra: str, seeds: tuple[int, ...] = ()) -> list[tuple[str, int]]:
        args = [*_model(tiny_models), *extra]
        got = []
        with ServerProcess(args, tmp_path / "server.log", env={"LOCALKV_HOME": str(tmp_path)}) as p:
            api = OpenAI(base_url=p.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
            for body in bodies + [{**bodies[1], "seed": s} for s in seeds]:
                r = api.chat.completions.create(model="tiny", messages=messages, **body)  # type: ignore[call-overload]
                got.append(
                    (r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)
                )
        return got

    answers()  # fills the disk cache
    cached = answers()  # a new process: the system prompt comes from the disk
    uncached = answers("--no-cache", seeds=(6,))
    assert all(n > 512 for _, n in cached)
    assert [text for text, _ in cached] == [text for text, _ in uncached[:3]]
    assert uncached[3][0] != uncached[1][0]  # another seed, another answer
