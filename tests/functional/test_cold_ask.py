"""A cold ``localkv ask`` says what it will prefill, shows it going and can be cancelled;
a miss names its nearest cause; a hit's saved time is one figure per prefix."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.tinymodels import TinyModels

from localkv.cli import cli

SYSTEM = "Answer from the document."
WAIT_S = 300  # liveness only


@pytest.fixture()
def env(tmp_path: Path, tiny_models: TinyModels) -> dict[str, str]:
    return {
        **os.environ,
        "LOCALKV_MODEL": str(tiny_models.base),
        "LOCALKV_HOME": str(tmp_path / "cache"),
        "LOCALKV_OTHER_TASKS": "0",
        "COLUMNS": "120",
    }


@pytest.fixture()
def doc(tmp_path: Path, long_text: str) -> Path:
    path = tmp_path / "doc.txt"
    path.write_text(long_text[:6000], encoding="utf-8")
    return path


def run(env: dict[str, str], *args: str, code: int = 0) -> tuple[str, str]:
    result = CliRunner().invoke(cli, list(args), env=env)
    assert result.exit_code == code, (result.output, result.stderr)
    return result.stdout, result.stderr


def ask_json(env: dict[str, str], *args: str) -> dict[str, dict[str, object]]:
    out, _ = run(env, "ask", "--threads", "1", "--max-tokens", "2", "--json", *args)
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_cold_ask_says_what_it_will_prefill_first(env: dict[str, str], doc: Path) -> None:
    _, err = run(env, "ask", "--threads", "1", "--max-tokens", "2", str(doc), "Who?")
    first = err.strip().splitlines()[0]
    tokens = ask_json(env, "--no-cache", str(doc), "Who?")["tokens"]["prompt"]
    assert first == f"prefilling {tokens:,} tokens (not cached yet)", err


def _read_until(fd: int, wanted: bytes, proc: subprocess.Popen[bytes]) -> bytes:
    seen = b""
    deadline = time.monotonic() + WAIT_S
    while wanted not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, seen
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            with contextlib.suppress(OSError):
                seen += os.read(fd, 4096)
    return seen


def test_a_cold_ask_on_a_terminal_shows_progress_and_ctrl_c_keeps_its_blocks(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    doc = tmp_path / "long.txt"
    doc.write_text(" ".join([long_text] * 3), encoding="utf-8")
    ctx = ["--ctx", "16384", "--threads", "1"]
    main, other = os.openpty()  # stderr is a terminal, as a user's is
    args = [sys.executable, "-m", "localkv", "ask", *ctx, "--max-tokens", "2", str(doc), "Who?"]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=other, env=env) as proc:
        os.close(other)
        seen = _read_until(main, b"prefilling ", proc)
        seen += _read_until(main, b" tok/s", proc)  # the bar, with its rate: a batch is done
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=WAIT_S)
        with contextlib.suppress(OSError):
            while chunk := os.read(main, 4096):
                seen += chunk
    os.close(main)
    text = seen.decode(errors="replace")
    assert proc.returncode == 130, text
    assert "cancelled: kept " in text, text
    kept = int(text.split("cancelled: kept ")[1].split(" ")[0].replace(",", ""))
    assert kept > 0 and out == b""
    again = ask_json(env, *ctx, str(doc), "Who?")
    assert again["tokens"]["reused"] == kept, again
    assert again["cache"]["verified"] is True


def test_an_ask_without_a_terminal_says_what_it_will_prefill(
    env: dict[str, str], doc: Path
) -> None:
    args = ["ask", "--threads", "1", "--max-tokens", "2", str(doc), "Who?"]
    done = subprocess.run(
        [sys.executable, "-m", "localkv", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("prefilling "), done.stderr


def test_saved_time_is_one_figure_for_one_prefix_whatever_the_context(
    env: dict[str, str], doc: Path, tmp_path: Path, long_text: str
) -> None:
    other = tmp_path / "other.txt"
    other.write_text(long_text[6000:9000], encoding="utf-8")
    ask_json(env, "--ctx", "4096", str(other), "What?")  # a rate timed at this context
    run(env, "prefill", "--threads", "1", "--ctx", "2048", str(doc))
    at_2048 = ask_json(env, "--ctx", "2048", str(doc), "Who?")
    at_4096 = ask_json(env, "--ctx", "4096", str(doc), "Where?")
    assert at_2048["tokens"]["reused"] == at_4096["tokens"]["reused"] > 0
    assert at_2048["cache"]["saved_s"] == at_4096["cache"]["saved_s"]


def test_a_near_miss_names_the_snapshot_and_the_system_prompt_it_was_made_with(
    env: dict[str, str], doc: Path
) -> None:
    run(env, "prefill", "--threads", "1", "--system", SYSTEM, str(doc))
    made = f'snapshot "doc.txt" was made with --system "{SYSTEM}"'
    _, err = run(env, "ask", "--threads", "1", "--max-tokens", "2", str(doc), "Who?")
    assert f"cache miss (not cached with this system prompt; {made}); prefilled" in err, err
    cache = ask_json(env, "--system", "Answer briefly.", str(doc), "Who?")["cache"]
    assert cache["miss_reason"] == f"not cached with this system prompt; {made}", cache
    hit = ask_json(env, "--system", SYSTEM, str(doc), "Who?")["cache"]
    assert hit["hit"] is True and hit["miss_reason"] is None
    elsewhere = ask_json(env, "--namespace", "theirs", str(doc), "Who?")["cache"]
    assert elsewhere["miss_reason"] == "not cached yet in namespace 'theirs'"  # none named


def test_a_near_miss_names_a_prefill_made_without_a_system_prompt(
    env: dict[str, str], doc: Path
) -> None:
    run(env, "prefill", "--threads", "1", str(doc))
    cache = ask_json(env, "--system", SYSTEM, str(doc), "Who?")["cache"]
    assert cache["miss_reason"] == (
        'not cached with this system prompt; snapshot "doc.txt" was made with no --system'
    )


def test_a_near_miss_names_the_model_the_snapshot_was_made_with(
    env: dict[str, str], doc: Path, tiny_models: TinyModels
) -> None:
    run(env, "prefill", "--threads", "1", str(doc))
    other = ["--model", str(tiny_models.other_weights)]
    cache = ask_json(env, *other, str(doc), "Who?")["cache"]
    assert cache["miss_reason"] == (
        'not cached with this model or settings; snapshot "doc.txt" was made with '
        f"--model {tiny_models.base.stem} (identity differs: model_sha256)"
    ), cache
