"""``localkv models`` and ``--model NAME``: models planted where LM Studio, Ollama and the
Hugging Face cache keep them, under a temporary HOME, found and loaded by name."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
from support.tinyarch import build_tiny_arch_models
from support.tinymodels import TinyModels, build_tiny_llama

from localkv.model.context import (
    ENV_MEMORY,
    FLOOR,
    MEMORY_SHARE,
    default_context,
    kv_bytes_per_token,
)
from localkv.model.find import FoundModel, describe
from localkv.model.ggufmeta import GGUFArray, GGUFError, read_gguf_metadata


@dataclass(frozen=True)
class Planted:
    home: Path
    env: dict[str, str]
    paths: dict[str, Path]  # name -> the file it must resolve to


def _link(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


def _header_only(path: Path, arch: str, **keys: int) -> Path:
    """A GGUF with metadata and no tensors: enough for ``localkv models``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    for key, value in keys.items():
        writer.add_uint32(f"{arch}.{key.replace('__', '.')}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _ollama(root: Path, name: str, tag: str, blob_source: Path) -> Path:
    digest = hashlib.sha256(blob_source.read_bytes()).hexdigest()
    blob = _link(blob_source, root / "blobs" / f"sha256-{digest}")
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob


@pytest.fixture
def planted(tmp_path: Path, tiny_models: TinyModels) -> Planted:
    home = tmp_path / "home"
    lms = home / ".lmstudio" / "models" / "someone" / "tiny-GGUF"
    hub = tmp_path / "hf" / "hub" / "models--org--tiny-GGUF"
    (hub / "refs").mkdir(parents=True)
    (hub / "refs" / "main").write_text("abc123")
    ollama = tmp_path / "ollama"
    paths = {
        "tiny-lms": _link(tiny_models.base, lms / "tiny-lms.gguf"),
        "tiny-q8": _link(tiny_models.q8_0, home / ".cache/lm-studio/models/a/b/tiny-q8.gguf"),
        "tiny-hf": _link(tiny_models.base, hub / "snapshots" / "abc123" / "tiny-hf.gguf"),
        "tinyllm:1b": _ollama(ollama, "tinyllm", "1b", tiny_models.other_weights),
        "tiny-dir": _link(tiny_models.base, tmp_path / "mine" / "tiny-dir.gguf"),
        "windowed": _header_only(lms / "windowed.gguf", "gemma3", attention__sliding_window=512),
        "snake": _header_only(lms / "snake.gguf", "mamba", ssm__conv_kernel=4),
        "mixed": _header_only(lms / "mixed.gguf", "jamba", attention__head_count=4),
        "mixed-swa": _header_only(
            lms / "mixed-swa.gguf", "jamba", attention__head_count=4, attention__sliding_window=64
        ),
    }
    _link(tiny_models.base, hub / "snapshots" / "old999" / "tiny-hf.gguf")  # not main's
    (lms / "mmproj-tiny.gguf").write_bytes(b"GGUF")  # a vision projector: not a model
    (lms / "big-00002-of-00002.gguf").write_bytes(b"GGUF")  # a later part of a split
    paths["broken"] = lms / "broken.gguf"
    paths["broken"].write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 16)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(
        HOME=str(home),
        HF_HOME=str(tmp_path / "hf"),
        OLLAMA_MODELS=str(ollama),
        LOCALKV_MODELS=str(tmp_path / "mine"),
    )
    return Planted(home, env, paths)


def _localkv(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "localkv", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def test_models_finds_lm_studio_ollama_and_the_hugging_face_cache(planted: Planted) -> None:
    done = _localkv(planted.env, "models", "--json")
    assert done.returncode == 0, done.stderr
    rows = {m["name"]: m for m in json.loads(done.stdout.splitlines()[-1])["models"]}
    assert {name: Path(rows[name]["path"]) for name in planted.paths} == planted.paths
    assert [r["source"] for r in rows.values()].count("default") == 1
    sources = {name: rows[name]["source"] for name in ("tiny-lms", "tiny-hf", "tinyllm:1b")}
    assert sources == {"tiny-lms": "lmstudio", "tiny-hf": "huggingface", "tinyllm:1b": "ollama"}
    assert rows["tiny-dir"]["source"] == "LOCALKV_MODELS"
    assert not any(name.startswith(("mmproj", "big")) for name in rows)
    assert sum(name == "tiny-hf" for name in rows) == 1  # only the revision main names
    reader = gguf.GGUFReader(planted.paths["tiny-lms"])
    tiny = rows["tiny-lms"]
    assert tiny["architecture"] == "llama"
    assert tiny["parameters"] == sum(int(t.n_elements) for t in reader.tensors)
    assert tiny["quantization"] == "F32" and rows["tiny-q8"]["quantization"] == "Q8_0"
    assert tiny["size"] == planted.paths["tiny-lms"].stat().st_size
    memory = {name: (rows[name]["memory"], rows[name]["cacheable"]) for name in rows}
    assert memory["tiny-lms"] == ("attention", True)
    assert memory["windowed"] == ("sliding-window", True)
    assert memory["snake"] == ("recurrent", True)
    assert memory["mixed"] == ("hybrid", True)
    assert memory["mixed-swa"] == ("hybrid", False)
    refusal = rows["mixed-swa"]["cache_refusal"]
    assert "jamba" in refusal and "sliding-window" in refusal
    assert rows["tiny-lms"]["cache_refusal"] is None
    assert rows["broken"]["error"] and memory["broken"] == ("unknown", False)


def test_models_table_fits_80_columns(planted: Planted) -> None:
    done = _localkv(planted.env, "models")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    titles = "NAME SOURCE ARCH PARAMS QUANT SIZE MEMORY CACHE"
    assert lines[0].split() == titles.split()
    assert all(len(line) <= 80 for line in lines)
    for name in planted.paths:  # each name whole, as --model takes it
        assert any(line.split()[:1] == [name] for line in lines), name
    assert any("unreadable:" in line for line in lines)


def test_models_table_says_what_json_says(planted: Planted) -> None:
    """The table's SOURCE, MEMORY and CACHE cells are --json's source, memory and cacheable."""
    rows = {
        m["name"]: m for m in json.loads(_localkv(planted.env, "models", "--json").stdout)["models"]
    }
    cells = _table_rows(_localkv(planted.env, "models").stdout.splitlines()[1:])
    for name in ("tiny-dir", "tiny-hf", "windowed", "snake", "mixed-swa"):
        row = rows[name]
        words = [row["source"], row["memory"], "yes" if row["cacheable"] else "no"]
        assert [cells[name][0], *cells[name][-2:]] == words, name


def test_ask_loads_a_model_by_its_listed_name(planted: Planted, tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("A document about nothing much.", encoding="utf-8")
    answers = {}
    for name in ("tinyllm:1b", "tinyllm:1b", "tiny-hf"):
        args = ["--model", name, "--threads", "1", "--ctx", "512", "--max-tokens", "4"]
        done = _localkv(planted.env, "ask", *args, "--json", "--temperature", "0", str(doc), "Why?")
        assert done.returncode == 0, done.stderr
        answers.setdefault(name, []).append(json.loads(done.stdout.splitlines()[-1]))
    assert answers["tinyllm:1b"][1]["cache"]["hit"]  # the same file, found again by name
    assert not answers["tiny-hf"][0]["cache"]["hit"]  # another model: other weights


def test_an_unknown_model_name_lists_close_matches(planted: Planted, tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("A document.", encoding="utf-8")
    done = _localkv(planted.env, "ask", "--model", "tinyllm:2b", str(doc), "Why?")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "no model file or listed model named 'tinyllm:2b'" in done.stderr
    assert "close matches: tinyllm:1b" in done.stderr


def test_nothing_is_listed_where_nothing_is_present(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "OLLAMA", "LOCALKV_M"))}
    env["HOME"] = str(tmp_path)
    done = _localkv(env, "models", "--json")
    assert done.returncode == 0, done.stderr
    sources = [m["source"] for m in json.loads(done.stdout)["models"]]
    assert sources == ["default", "package"]  # and Gemma 3 270M's parts, from the dev extra


# ------------------------------------------------------- the CACHE column and prefill
def _every_architecture(directory: Path, tiny_models: TinyModels, tokenizer: Path) -> set[str]:
    """Every architecture the test model generators build, in one directory; their names."""
    build_tiny_arch_models(directory, tokenizer)
    _link(tiny_models.base, directory / "tiny-llama.gguf")
    return {path.stem for path in directory.glob("*.gguf")}


def _cache_column(table: str) -> dict[str, str]:
    """Model name -> its CACHE cell, from the ``models`` table."""
    lines = table.splitlines()
    assert lines[0].split()[-1] == "CACHE"
    return {name: cells[-1] for name, cells in _table_rows(lines[1:]).items()}


def _table_rows(lines: list[str]) -> dict[str, list[str]]:
    """Model name -> its other cells; a name too long for its column has a line of its own."""
    rows: dict[str, list[str]] = {}
    for i, line in enumerate(lines):
        if line.startswith(" "):
            rows[lines[i - 1].strip()] = line.split()
        elif len(line.split()) > 1:
            rows[line.split()[0]] = line.split()[1:]
    return rows


def test_the_cache_column_says_what_prefill_does(
    tmp_path: Path, tiny_models: TinyModels, default_model_path: Path
) -> None:
    """yes: prefill saves blocks of the whole document; no: it exits 1 with the listed reason."""
    names = _every_architecture(tmp_path / "models", tiny_models, default_model_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "OLLAMA"))}
    env.update(HOME=str(tmp_path), LOCALKV_MODELS=str(tmp_path / "models"))
    env["LOCALKV_HOME"] = str(tmp_path / "cache")
    listed = _localkv(env, "models", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {m["name"]: m for m in json.loads(listed.stdout.splitlines()[-1])["models"]}
    rows = {name: row for name, row in rows.items() if row["source"] == "LOCALKV_MODELS"}
    assert set(rows) == names
    column = _cache_column(_localkv(env, "models").stdout)
    assert {row["cacheable"] for row in rows.values()} == {True, False}  # both outcomes seen
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"Chapter {i}. Alice sat by the river." for i in range(60)))
    for name, row in sorted(rows.items()):
        assert column[name] == ("yes" if row["cacheable"] else "no"), name
        args = ["--model", name, "--threads", "1", "--ctx", "2048", "--json", str(doc)]
        done = _localkv(env, "prefill", *args)
        assert "Traceback" not in done.stderr, name
        out = json.loads(done.stdout.splitlines()[-1])
        if row["cacheable"]:
            assert done.returncode == 0, (name, done.stderr)
            assert out["new_blocks"] >= 2 and out["kept"] == out["tokens"] > 256, name
        else:
            assert done.returncode == 1, name
            assert row["cache_refusal"] in out["error"], (name, out["error"])


def test_memory_of_another_kind_is_listed_as_not_cached_with_the_reason(tmp_path: Path) -> None:
    """Architectures whose llama.cpp memory keeps more than localkv stores (model.memories)."""
    for arch, why in (("deepseek32", "indexer key cache"), ("nomic-bert", "no KV memory")):
        info = describe(
            FoundModel(name=arch, source="LOCALKV_MODELS", path=_header_only(tmp_path / arch, arch))
        )
        refusal = info.cache_refusal() or ""
        assert not info.cacheable and refusal.startswith(f"{arch}: ") and why in refusal


# ------------------------------------------------------------------- the header reader
def test_the_header_reader_agrees_with_gguf_reader(tiny_models: TinyModels) -> None:
    meta = read_gguf_metadata(tiny_models.base)
    reader = gguf.GGUFReader(tiny_models.base)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        ours = meta.values[key]
        if isinstance(ours, GGUFArray):
            assert ours.length == len(field.data)
        elif isinstance(ours, float):
            assert ours == pytest.approx(field.contents())
        else:
            assert (list(ours) if isinstance(ours, tuple) else ours) == field.contents()
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert {t.name: t.shape for t in meta.tensors} == shapes


@pytest.mark.parametrize("cut", [3, 8, 24, 100, 5000])
def test_a_truncated_header_is_an_error_not_a_crash(
    tmp_path: Path, tiny_models: TinyModels, cut: int
) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_models.base.read_bytes()[:cut])
    with pytest.raises(GGUFError):
        read_gguf_metadata(path)
    info = describe(FoundModel(name="cut", source="LOCALKV_MODELS", path=path))
    assert info.error and info.memory == "unknown" and not info.cacheable


def test_an_implausible_length_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "huge.gguf"
    header = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little")
    path.write_bytes(header + (1).to_bytes(8, "little") + (2**62).to_bytes(8, "little"))
    with pytest.raises(GGUFError, match="implausible"):
        read_gguf_metadata(path)


GEMMA = "gemma-3-270m-q4_k_m"


def _bare_env(tmp_path: Path) -> dict[str, str]:
    """A new user's environment: no LOCALKV_MODELS, nothing in HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "OLLAMA", "LOCALKV_M"))}
    env.update(HOME=str(tmp_path / "home"), XDG_DATA_HOME=str(tmp_path / "data"))
    return env


def test_a_model_installed_from_pypi_in_parts_is_listed_with_no_variable(tmp_path: Path) -> None:
    """Gemma 3 270M, installed as its four chunk packages (the dev extra), is listed from
    its first part's header before anything is joined."""
    done = _localkv(_bare_env(tmp_path), "models", "--json")
    assert done.returncode == 0, done.stderr
    rows = {m["name"]: m for m in json.loads(done.stdout.splitlines()[-1])["models"]}
    gemma = rows[GEMMA]
    assert gemma["source"] == "package" and gemma["architecture"] == "gemma3"
    assert gemma["memory"] == "sliding-window" and gemma["cacheable"]
    assert gemma["path"] == str(tmp_path / "data" / "localkv" / "models" / f"{GEMMA}.gguf")
    assert not (tmp_path / "data").exists()  # listing joins nothing


@pytest.mark.default_model
def test_a_model_in_parts_is_joined_once_when_loaded_by_name(
    tmp_path: Path, gemma3_path: Path
) -> None:
    env = _bare_env(tmp_path)
    doc = tmp_path / "doc.txt"
    doc.write_text("A short note.", encoding="utf-8")
    args = ["--model", GEMMA, "--threads", "1", "--ctx", "256", "--max-tokens", "1", "--json"]
    for joins in (1, 0):  # the second run finds the joined file
        done = _localkv(env, "ask", *args, "--temperature", "0", str(doc), "Why?")
        assert done.returncode == 0, done.stderr
        assert done.stderr.count("joining") == joins
    joined = tmp_path / "data" / "localkv" / "models" / f"{GEMMA}.gguf"
    assert joined.read_bytes() == gemma3_path.read_bytes()


# ------------------------------------------------------- the context a command opens
GPL3 = Path("/usr/share/common-licenses/GPL-3")


@pytest.mark.skipif(not GPL3.is_file(), reason="needs Debian's common-licenses")
def test_a_long_document_prefills_with_no_ctx_where_the_model_was_trained_for_it(
    tmp_path: Path, default_model_path: Path
) -> None:
    """The GPL-3 text (more than 4,096 tokens on SmolLM2's tokenizer) fits the context of
    a model trained for 8,192 tokens without --ctx."""
    model = build_tiny_llama(tmp_path / "tiny-8k.gguf", default_model_path, context_length=8192)
    env = {**os.environ, "LOCALKV_HOME": str(tmp_path / "cache"), ENV_MEMORY: str(16 << 30)}
    args = ["--model", str(model), "--threads", "1", "--json", str(GPL3)]
    done = _localkv(env, "prefill", *args)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert 4096 < report["tokens"] <= 8192


def test_models_reports_the_context_each_model_opens_with(tmp_path: Path) -> None:
    """SmolLM2 was trained for 8,192 tokens and Gemma 3 270M for 32,768: their KV caches
    at those lengths fit a quarter of 16 GiB, and not of 1 GiB."""
    done = _localkv({**_bare_env(tmp_path), ENV_MEMORY: str(16 << 30)}, "models", "--json")
    rows = {m["name"]: m for m in json.loads(done.stdout.splitlines()[-1])["models"]}
    smollm2 = rows["SmolLM2-135M-Instruct.Q4_1"]
    assert (smollm2["context_length"], smollm2["ctx"]) == (8192, 8192)
    assert (rows[GEMMA]["context_length"], rows[GEMMA]["ctx"]) == (32768, 32768)
    small = _localkv({**_bare_env(tmp_path), ENV_MEMORY: str(1 << 30)}, "models", "--json")
    rows = {m["name"]: m for m in json.loads(small.stdout.splitlines()[-1])["models"]}
    assert 4096 <= rows[GEMMA]["ctx"] < 32768  # a quarter of 1 GiB holds less


def test_the_context_is_lowered_to_what_memory_holds(default_model_path: Path) -> None:
    per_token = kv_bytes_per_token(read_gguf_metadata(default_model_path))
    assert per_token is not None
    six_k = 6 * 1024 * per_token * MEMORY_SHARE
    assert default_context(default_model_path, available=six_k + per_token) == 6 * 1024
    assert default_context(default_model_path, available=per_token) == FLOOR  # never below
    assert default_context(default_model_path, available=1 << 40) == 8192  # never above


def _plant_dist(site: Path, name: str, files: dict[str, bytes]) -> None:
    """An installed distribution as pip leaves one: its files and a RECORD naming them."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    lines = [f"{rel},," for rel in files] + [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("sums", ["right", "wrong", "missing part"])
def test_a_split_model_is_joined_only_whole_and_as_its_sums_say(
    tmp_path: Path, tiny_models: TinyModels, sums: str
) -> None:
    data = tiny_models.base.read_bytes()
    digest = hashlib.sha256(data if sums != "wrong" else b"other").hexdigest()
    site = tmp_path / "site"
    half = len(data) // 2
    if sums != "missing part":
        first = {"tinysplit_part1/tiny-split.gguf.part00": data[:half]}
        _plant_dist(site, "tinysplit-part1", first)
    _plant_dist(site, "tinysplit-part2", {"tinysplit_part2/tiny-split.gguf.part01": data[half:]})
    line = f"{digest}  tiny-split.gguf\n".encode()
    _plant_dist(site, "tinysplit", {"tinysplit/SHA256SUMS": line})
    env = {**_bare_env(tmp_path), "PYTHONPATH": str(site), "LOCALKV_HOME": str(tmp_path / "c")}
    listed = json.loads(_localkv(env, "models", "--json").stdout.splitlines()[-1])["models"]
    assert ("tiny-split" in [m["name"] for m in listed]) == (sums != "missing part")
    doc = tmp_path / "doc.txt"
    doc.write_text("A note.", encoding="utf-8")
    args = ["--model", "tiny-split", "--threads", "1", "--max-tokens", "1", str(doc), "Why?"]
    done = _localkv(env, "ask", *args)
    joined = tmp_path / "data" / "localkv" / "models" / "tiny-split.gguf"
    if sums == "right":
        assert done.returncode == 0, done.stderr
        assert joined.read_bytes() == data
        return
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert not joined.parent.exists() or not any(joined.parent.iterdir())  # nothing half-joined
    reason = "do not match the package's SHA256SUMS" if sums == "wrong" else "no model file"
    assert reason in done.stderr.splitlines()[-1]
