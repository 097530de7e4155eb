"""What the first request after a restart looks up in the disk cache's index.

With nothing in the live context it is restored with one lookup: the restore's
own. Of stored blocks that hold as much of the prompt, the lookup takes the one
ending where the prompt ends, so no token is computed again. Counted in lookups
and tokens, never timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from support.tinymodels import TinyModels, tiny_config

from localkv.prompt.template import Message
from localkv.runtime import Runtime
from localkv.server.engine import Engine
from localkv.server.requests import ChatRequest, Outcome, Sampling


class Client:
    """A client that stays for the whole answer."""

    def __init__(self) -> None:
        self.arrived = time.perf_counter()

    def started(self) -> None:
        pass

    def text(self, piece: str) -> None:
        pass

    def reasoning(self, piece: str) -> None:
        pass

    def cancelled(self) -> bool:
        return False


def _request(system: str, question: str) -> ChatRequest:
    sampling = Sampling(temperature=0.0, top_p=1.0, top_k=0, seed=None, max_tokens=4, stop=())
    messages = (Message("system", system), Message("user", question))
    return ChatRequest(messages=messages, sampling=sampling, stream=True, include_usage=True)


def _counting_lookups(rt: Runtime) -> list[int]:
    """The length of each prompt ``rt``'s cache plans a restore for (the real lookup runs)."""
    cache = rt.cache
    assert cache is not None
    lookups: list[int] = []
    plan: Callable[..., Any] = cache.plan

    def counted(tokens: Sequence[int], ends: Sequence[int]) -> Any:
        lookups.append(len(tokens))
        return plan(tokens, ends)

    cache.plan = counted  # type: ignore[method-assign]
    return lookups


def _chat(rt: Runtime, request: ChatRequest) -> Outcome:
    return Engine(rt).chat(request, Client())


def test_the_first_request_after_a_restart_looks_its_prompt_up_once(
    tiny_models: TinyModels, tmp_path: Path, long_text: str
) -> None:
    request = _request(long_text[:6000], "Who is tired?")
    config = tiny_config(tiny_models.base, n_ctx=4096)
    with Runtime(config, cache_dir=tmp_path) as rt:  # the server before its restart
        first = _chat(rt, request)
    assert first.source == "none"
    with Runtime(config, cache_dir=tmp_path) as rt:  # restarted: the live context is empty
        lookups = _counting_lookups(rt)
        after = _chat(rt, request)
    assert after.source == "disk"
    assert after.cached_tokens >= after.prompt_tokens - 1
    assert lookups == [after.prompt_tokens]


def _siblings_after(rt: Runtime, tokens: list[int], start: int) -> list[int]:
    """The ends of the stored blocks that follow ``tokens[:start]``, in the index's order."""
    cache = rt.cache
    assert cache is not None
    chain = cache.plan(tokens[:start], rt.session.schedule(start, [start]))
    parent = chain.chain[-1].hash if chain.chain else None
    scope = (cache.identity.digest, cache.namespace)
    return [b.end for b in cache.store.children(parent, *scope, first_token=tokens[start])]


def test_a_prompt_saved_with_longer_answers_after_it_is_restored_whole(
    tiny_models: TinyModels, tmp_path: Path, long_text: str
) -> None:
    """Blocks ending at the prompt's end and after each answer start at the same block
    end: the restore takes the one ending where the prompt ends, so the prompt's last
    token is not cut off and computed again, whichever the index lists first."""
    config = tiny_config(tiny_models.base, n_ctx=2048)
    with Runtime(config, cache_dir=tmp_path) as rt:
        vocab = rt.template.tokenizer
        prompt = vocab.text(long_text)[:700]
        block = rt.session.config.block_size
        start = len(prompt) // block * block
        for answer in range(2, 40):  # until a longer block comes first in the index
            tokens = prompt + vocab.text(f" answer {answer}")
            tips = [len(prompt), len(tokens)]
            rt.session.reset()
            rt.session.prefill(tokens, ends=rt.session.schedule(len(tokens), tips))
            rt.save_prefix(tips)
            rt.wait_for_saves()
            ends = _siblings_after(rt, prompt, start)
            if ends[0] > len(prompt):
                break
        assert len(prompt) in ends[1:]
    with Runtime(config, cache_dir=tmp_path) as rt:  # restarted
        result, _ = rt.restore(prompt, rt.session.schedule(len(prompt), [len(prompt)]))
    assert result is not None
    assert result.reused == len(prompt)
