"""Codex CLI (npm ``@openai/codex``, pinned) on ``localkv serve``'s Responses API.

Run as the README sets it up, with nothing else: ``~/.codex/config.toml`` naming
the server as a model provider with ``wire_api = "responses"`` (and the two
settings that keep it from calling anywhere but the server), then ``codex exec``.
Codex sends its default tools (a ``namespace`` of sub-agent tools, a hosted
``web_search``) and no output bound. The cold turn completes with no error
answer; ``codex exec resume --last`` reads at least 90% of its prompt from the
live context; after a restart a new session with another question reads at
least 90% from disk (its environment context, with the date and directory, moves
between sessions; its instructions and tools do not).
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

PACKAGE = "@openai/codex"


def codex_config(served: Served) -> str:
    """The README's ``~/.codex/config.toml``, exactly."""
    return f"""\
model = "local"                  # any name: the loaded model answers
model_provider = "localkv"

[model_providers.localkv]
name = "localkv"
base_url = "{served.url}/v1"
wire_api = "responses"

[analytics]
enabled = false                  # no usage events to OpenAI

[features]
plugins = false                  # no plugin catalogue from GitHub and ChatGPT
"""


def test_codex_cold_resume_and_new_session_after_restart(
    served: Served, project: Path, tmp_path: Path
) -> None:
    codex = str(npm_client("codex"))
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(codex_config(served), encoding="utf-8")
    env = client_env(home)
    assert pinned_npm_version(PACKAGE) in version_of([codex, "--version"], env)

    cold = run_turn(served, [codex, "exec", "What does greet.py do?"], cwd=project, env=env)
    assert all(r.path == "/v1/responses" for r in cold.answered), cold

    more = run_turn(
        served,
        [codex, "exec", "resume", "--last", "Say it in one word."],
        cwd=project,
        env=env,
    )
    first = more.answered[0]
    assert first.source == "live" and first.cached >= 0.90 * first.prompt, more

    served.restart()
    fresh = run_turn(served, [codex, "exec", "Which files are here?"], cwd=project, env=env)
    first = fresh.answered[0]
    assert first.source == "disk" and first.cached >= 0.90 * first.prompt, fresh
