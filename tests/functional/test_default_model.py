"""End to end on the real default model (SmolLM2-135M-Instruct): across processes."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.default_model


def _cli(env: dict[str, str], *args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "localkv", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _formats(cache: Path) -> set[str]:
    """The formats of the block files under ``cache``."""
    out = set()
    for path in cache.rglob("*.lkv"):
        data = path.read_bytes()
        (n,) = struct.unpack_from("<Q", data)
        out.add(json.loads(data[8 : 8 + n])["__metadata__"]["format"])
    return out


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "compact"])
def test_restore_in_another_process_continues_exactly(
    tmp_path: Path, default_model_path: Path, long_text: str, compact: bool
) -> None:
    """A prefills ~2,000 tokens and exits; B restores them verified; 64 greedy tokens match."""
    doc = tmp_path / "doc.txt"
    doc.write_text(long_text[:9000], encoding="utf-8")
    env = {**os.environ, "LOCALKV_HOME": str(tmp_path / "cache")}
    env.pop("LOCALKV_MODEL", None)
    system = "You are a careful reader. Answer from the document."
    pre = _cli(
        env, "prefill", *(["--compact-cache"] if compact else []), "--system", system, str(doc)
    )
    assert 1900 <= int(pre["tokens"]) <= 2300  # type: ignore[call-overload]
    assert _formats(tmp_path / "cache") == {"lkv-planes2" if compact else "lkv-block2"}
    ask = ["ask", "--system", system, "--temperature", "0", "--max-tokens", "64"]
    question = "Who is the story about, and what does she do?"
    cached = _cli(env, *ask, str(doc), question)
    uncached = _cli(env, *ask, "--no-cache", str(doc), question)
    assert cached["cache"]["verified"] is True  # type: ignore[index]
    assert cached["tokens"]["reused"] == pre["tokens"]  # type: ignore[index]
    assert cached["tokens"]["generated"] == uncached["tokens"]["generated"]  # type: ignore[index]
    assert cached["tokens"]["generated"] > 8  # type: ignore[index]
    assert cached["answer"] == uncached["answer"]


def test_a_document_attached_after_a_chat_turn_answers_as_uncached(
    tmp_path: Path, default_model_path: Path, long_text: str
) -> None:
    """The sequence that once served blocks computed from position 3 as canonical ones.

    A chat turn, ``/new``, then a document attached: the attach shares only the
    user-turn opener with the first conversation's blocks. A later ``ask`` over
    the document must answer exactly as ``--no-cache`` does.
    """
    licence = Path("/usr/share/common-licenses/Apache-2.0")
    doc = tmp_path / "Apache-2.0"
    text = licence.read_text(encoding="utf-8") if licence.is_file() else long_text[:11000]
    doc.write_text(text, encoding="utf-8")
    env = {**os.environ, "LOCALKV_HOME": str(tmp_path / "cache")}
    env.pop("LOCALKV_MODEL", None)
    chat_input = (
        f"What is the capital of France?\n/new\n/attach {doc}\n"
        "Can I use this license for commercial software? Answer in one word.\n/quit\n"
    )
    command = [sys.executable, "-m", "localkv", "chat", "--plain", "--temperature", "0"]
    chat = subprocess.run(
        [*command, "--max-tokens", "16"],
        env=env,
        input=chat_input,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert chat.returncode == 0, chat.stderr
    ask = ["ask", str(doc), "Who owns the copyright?", "--temperature", "0", "--max-tokens", "24"]
    cached = _cli(env, *ask)
    uncached = _cli(env, *ask, "--no-cache")
    assert cached["tokens"]["reused"] > 1000  # type: ignore[index]
    assert cached["cache"]["verified"] is True  # type: ignore[index]
    assert cached["answer"] == uncached["answer"]
