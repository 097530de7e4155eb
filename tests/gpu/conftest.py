"""Fixtures of the gpu set (``make gpu``): the device the GPU build offers."""

from __future__ import annotations

import os

import pytest

from localkv.model.devices import Device, offload_devices


@pytest.fixture(scope="session")
def device() -> Device:
    """The device layers are offloaded to; the set fails where the build offers none."""
    if not os.environ.get("LLAMA_CPP_LIB_PATH"):
        pytest.fail("the gpu set needs a GPU build: run it with make gpu")
    found = offload_devices()
    if not found:
        pytest.fail(
            "the GPU build offers no device (Vulkan on lavapipe: GGML_VK_VISIBLE_DEVICES=0)"
        )
    return found[0]
