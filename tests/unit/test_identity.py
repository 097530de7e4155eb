"""Identity: what must change the digest does, what must not does not."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from localkv.storage.filehash import FileHasher
from support.tinyarch import build
from support.tinymodels import TinyModels, tiny_config

from localkv.cache.identity import Identity, identity_of
from localkv.model.session import LoraSpec, ModelSession


def _identity(path: Path, **kw: object) -> Identity:
    with ModelSession(tiny_config(path, **kw)) as s:
        return identity_of(s, FileHasher())


@pytest.fixture(scope="module")
def base(tiny_models: TinyModels) -> Identity:
    return _identity(tiny_models.base)


@pytest.mark.parametrize(
    ("variant", "kw", "field"),
    [
        ("other_weights", {}, "model_sha256"),
        ("q8_0", {}, "model_sha256"),
        ("base", {"lora": 1.0}, "loras"),
        ("base", {"lora": 0.5}, "loras"),
        ("base", {"type_k": "q8_0"}, "type_k"),
        ("base", {"rope_freq_base": 20000.0}, "rope_freq_base"),
        ("base", {"flash_attn": "on"}, "v_trans"),  # auto on a CPU: off
    ],
)
def test_digest_changes_with_the_computation(
    tiny_models: TinyModels, base: Identity, variant: str, kw: dict[str, object], field: str
) -> None:
    options = dict(kw)
    if "lora" in options:
        options["loras"] = (LoraSpec(tiny_models.lora, float(options.pop("lora"))),)  # type: ignore[arg-type]
    other = _identity(getattr(tiny_models, variant), **options)
    assert other.digest != base.digest
    assert any(line.startswith(f"{field}:") for line in base.diff(other)), base.diff(other)


def test_lora_scales_differ_from_each_other(tiny_models: TinyModels) -> None:
    half = _identity(tiny_models.base, loras=(LoraSpec(tiny_models.lora, 0.5),))
    full = _identity(tiny_models.base, loras=(LoraSpec(tiny_models.lora, 1.0),))
    assert half.digest != full.digest


def test_thread_count_matters_only_with_flash_attention(tiny_models: TinyModels) -> None:
    one = _identity(tiny_models.base, flash_attn="on", n_threads=1)
    two = _identity(tiny_models.base, flash_attn="on", n_threads=2)
    assert "attn_threads: 1 → 2" in one.diff(two)
    assert _identity(tiny_models.base, n_threads=2) == _identity(tiny_models.base)


def test_auto_on_a_cpu_is_off_and_shares_its_cache(tiny_models: TinyModels, base: Identity) -> None:
    """``auto`` is off here (a CPU build, a small scratch): the cache of ``off``, not ``on``."""
    off = _identity(tiny_models.base, flash_attn="off")
    on = _identity(tiny_models.base, flash_attn="on")
    assert base.digest == off.digest and not base.flash_attn and base.v_trans
    assert on.digest != base.digest and on.flash_attn


@pytest.mark.parametrize(
    "kw",
    [
        {"n_ctx": 512},
        {"n_batch": 64},
        {"n_threads": 2},
        {"n_ctx": 512, "flash_attn": "on"},
        {"n_batch": 64, "flash_attn": "on"},
    ],
)
def test_digest_ignores_what_does_not_change_kv(
    tiny_models: TinyModels, base: Identity, kw: dict[str, object]
) -> None:
    reference = base if "flash_attn" not in kw else _identity(tiny_models.base, flash_attn="on")
    other = _identity(tiny_models.base, **kw)
    assert other.digest == reference.digest
    assert reference.diff(other) == []


def test_diff_is_readable(tiny_models: TinyModels, base: Identity) -> None:
    other = _identity(tiny_models.base, type_k="q8_0")
    assert "type_k: f16 → q8_0" in base.diff(other)


def test_identity_survives_a_json_round_trip(base: Identity) -> None:
    import json

    again = Identity.from_dict(json.loads(json.dumps(base.as_dict())))
    assert again == base
    assert again.digest == base.digest


def test_the_kv_cell_layout_is_part_of_the_representation(
    tmp_path: Path, default_model_path: Path, base: Identity
) -> None:
    """M-RoPE cells (qwen35) are named in the representation; plain cells leave it as it was."""
    qwen35 = _identity(build(tmp_path / "tiny-qwen35.gguf", "qwen35", default_model_path))
    assert qwen35.cell_ext
    assert qwen35.tiers()["representation"]["cell_ext"] is True
    assert not base.cell_ext
    assert "cell_ext" not in base.tiers()["representation"]
    flipped = dataclasses.replace(qwen35, cell_ext=False)
    assert flipped.digest != qwen35.digest
    assert "cell_ext: True → False" in qwen35.diff(flipped)


def test_model_hash_is_remembered_across_hashers(tmp_path: Path, tiny_models: TinyModels) -> None:
    db = tmp_path / "hashes.db"
    first = FileHasher(db).sha256(tiny_models.base)
    # a second hasher (another process) finds it in the table without reading the file
    import sqlite3

    rows = sqlite3.connect(db).execute("SELECT sha256 FROM file_hashes").fetchall()
    assert rows == [(first,)]
    assert FileHasher(db).sha256(tiny_models.base) == first


def test_engine_and_store_import_without_textual() -> None:
    code = (
        "import sys, localkv, localkv.storage, localkv.model.session, localkv.kv.codec; "
        "import localkv.cli; "
        "bad = [m for m in sys.modules if m == 'textual' or m.startswith('textual.')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_cpu_identity_names_no_split_and_a_device_one_names_its_split(base: Identity) -> None:
    """On the CPU the digest is what it was before devices were named (no ``offload``
    field in it); on a device, the device and every split are digests of their own."""
    assert base.backend == "cpu" and base.offload == ""
    assert "offload" not in base.tiers()["execution"]
    device = "Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits))"
    whole = dataclasses.replace(base, backend=device, offload="3/3 layers on the device")
    split = dataclasses.replace(whole, offload="1/3 layers on the device")
    assert whole.tiers()["execution"]["offload"] == "3/3 layers on the device"
    assert len({base.digest, whole.digest, split.digest}) == 3
    assert Identity.from_dict(split.as_dict()) == split


def test_an_identity_stored_before_devices_were_named_reads_as_the_cpu(base: Identity) -> None:
    stored = base.as_dict()
    assert "offload" not in stored  # the JSON a store already holds for this digest
    assert Identity.from_dict(stored) == base
