"""Claude Code (npm ``@anthropic-ai/claude-code``, pinned) on ``localkv serve``.

Run as the README sets it up, with nothing else: ``claude -p`` with the server's
root URL, any key and any model name, and the setting that keeps it from calling
anywhere but the server. Its first request is its whole system prompt and tools
(tens of thousands of tokens): the cold turn completes with no error answer, a
``--continue`` turn reads at least 95% of its prompt from the live context, and,
after the server restarts, a new session with a different question reads at
least 95% from disk (what a new session shares with the first is its system
prompt and tools).
"""

from __future__ import annotations

from pathlib import Path

from agentkit import (
    AGENTS_ONLY,
    Served,
    client_env,
    npm_client,
    pinned_npm_version,
    run_turn,
    version_of,
)

pytestmark = AGENTS_ONLY

PACKAGE = "@anthropic-ai/claude-code"


def claude_settings(served: Served) -> dict[str, str]:
    """The README's variables for Claude Code, exactly."""
    return {
        "ANTHROPIC_BASE_URL": served.url,
        "ANTHROPIC_API_KEY": "none",  # any text for a server without --api-key
        "ANTHROPIC_MODEL": "local",  # any name: the loaded model answers
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry, updates, reports
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",  # a cold prompt computes for minutes
        "API_TIMEOUT_MS": "1800000",
    }


def test_claude_code_cold_continue_and_new_session_after_restart(
    served: Served, project: Path, tmp_path: Path
) -> None:
    claude = str(npm_client("claude"))
    env = client_env(tmp_path / "home", **claude_settings(served))
    assert pinned_npm_version(PACKAGE) in version_of([claude, "--version"], env)

    cold = run_turn(served, [claude, "-p", "What does greet.py do?"], cwd=project, env=env)
    assert all(r.path.startswith("/v1/messages") for r in cold.answered), cold

    more = run_turn(
        served, [claude, "-p", "--continue", "Say it in one word."], cwd=project, env=env
    )
    first = more.answered[0]
    assert first.source == "live" and first.cached >= 0.95 * first.prompt, more

    served.restart()
    fresh = run_turn(served, [claude, "-p", "Which files are here?"], cwd=project, env=env)
    first = fresh.answered[0]
    assert first.source == "disk" and first.cached >= 0.95 * first.prompt, fresh
