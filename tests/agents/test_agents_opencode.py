"""opencode (npm ``opencode-ai``, pinned) on ``localkv serve``'s OpenAI API.

Set up as the README says: an openai-compatible provider in
``~/.config/opencode/opencode.json`` and two variables that keep it from fetching
model lists and updates. Each ``opencode run`` makes two requests at once (a title
and the agent's turn). The cold turn completes with no error answer; after a
restart a new session with another question reads at least 90% of its prompt
from disk (its system prompt and tools are the same).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentkit import (
    AGENTS_ONLY,
    CONTEXT,
    Served,
    client_env,
    npm_client,
    pinned_npm_version,
    run_turn,
    version_of,
)

pytestmark = AGENTS_ONLY

PACKAGE = "opencode-ai"
SETTINGS = {
    "OPENCODE_DISABLE_MODELS_FETCH": "1",  # no model list from models.dev
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
}


def opencode_config(served: Served) -> dict[str, Any]:
    """The README's ``~/.config/opencode/opencode.json``, exactly."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "localkv": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "localkv",
                "options": {"baseURL": f"{served.url}/v1"},
                "models": {
                    "local": {"name": "local", "limit": {"context": CONTEXT, "output": 4096}}
                },
            }
        },
        "model": "localkv/local",
        "small_model": "localkv/local",
        "autoupdate": False,
        "share": "disabled",
    }


def test_opencode_cold_and_new_session_after_restart(
    served: Served, project: Path, tmp_path: Path
) -> None:
    opencode = str(npm_client("opencode"))
    home = tmp_path / "home"
    config = home / ".config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps(opencode_config(served), indent=2), encoding="utf-8")
    env = client_env(home, **SETTINGS)
    assert pinned_npm_version(PACKAGE) in version_of([opencode, "--version"], env)

    cold = run_turn(served, [opencode, "run", "What does greet.py do?"], cwd=project, env=env)
    assert all(r.path == "/v1/chat/completions" for r in cold.answered), cold

    served.restart()
    fresh = run_turn(served, [opencode, "run", "Which files are here?"], cwd=project, env=env)
    assert fresh.share >= 0.90, fresh
