"""``--flash-attn auto``: what localkv passes to llama.cpp (``loading.flash_attn_setting``)."""

from __future__ import annotations

import dataclasses

import pytest
from support.tinymodels import TinyModels, tiny_config

from localkv.model.loading import AUTO_OFF_SCRATCH, attention_scratch, flash_attn_setting
from localkv.model.native import llama_cpp
from localkv.model.session import ModelSession

pytestmark = pytest.mark.skipif(
    bool(llama_cpp.llama_supports_gpu_offload()), reason="a GPU build: auto is llama.cpp's"
)


@pytest.fixture(scope="module")
def session(tiny_models: TinyModels) -> ModelSession:
    with ModelSession(tiny_config(tiny_models.base)) as s:
        yield s


def test_auto_is_off_on_a_cpu_and_reaches_llama_cpp(session: ModelSession) -> None:
    assert session.config.flash_attn == "auto"
    assert session.flash_attn_setting() == "off"
    session.prefill(session.tokenize("What llama.cpp did: V transposed, no flash attention."))
    assert session.capture().v_trans
    session.reset()


def test_auto_leaves_it_to_llama_cpp_past_the_scratch_bound(session: ModelSession) -> None:
    heads = int(llama_cpp.llama_model_n_head(session.model))
    cfg = session.config
    fits = AUTO_OFF_SCRATCH // (cfg.n_batch * heads * 4) // 256 * 256
    at = dataclasses.replace(cfg, n_ctx=fits)
    past = dataclasses.replace(cfg, n_ctx=fits + 256)
    assert attention_scratch(at, session.model) <= AUTO_OFF_SCRATCH
    assert attention_scratch(past, session.model) > AUTO_OFF_SCRATCH
    assert flash_attn_setting(at, session.model) == "off"
    assert flash_attn_setting(past, session.model) == "auto"


def test_a_quantized_v_needs_flash_attention(session: ModelSession) -> None:
    cfg = dataclasses.replace(session.config, type_v="q8_0")
    assert flash_attn_setting(cfg, session.model) == "auto"


@pytest.mark.parametrize("asked", ["on", "off"])
def test_an_explicit_setting_is_passed_as_asked(session: ModelSession, asked: str) -> None:
    big = dataclasses.replace(session.config, flash_attn=asked, n_ctx=10**6)
    assert flash_attn_setting(big, session.model) == asked
