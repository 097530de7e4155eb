"""aider (PyPI ``aider-chat``, pinned, in a virtual environment of its own) on
``localkv serve``'s Ollama API.

Set up as the README says: ``OLLAMA_API_BASE`` and ``--model ollama_chat/local``,
with ``~/.aider.conf.yml`` turning off its analytics and update checks and
``~/.aider.model.metadata.json`` describing the model (else aider and litellm
download a price list from GitHub; ``LITELLM_LOCAL_MODEL_COST_MAP`` keeps litellm's
own copy). The cold turn completes with no error answer; after a restart the same
command reads at least 90% of its prompt from disk.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentkit import (
    AGENTS_ONLY,
    CONTEXT,
    Served,
    client_env,
    pinned_pip_version,
    run_turn,
    venv_client,
    version_of,
)

pytestmark = AGENTS_ONLY

AIDER_CONF = """\
model: ollama_chat/local
analytics-disable: true
check-update: false
show-release-notes: false
"""
METADATA = {
    "ollama_chat/local": {
        "max_input_tokens": CONTEXT,
        "max_output_tokens": 4096,
        "input_cost_per_token": 0,
        "output_cost_per_token": 0,
        "litellm_provider": "ollama_chat",
        "mode": "chat",
    }
}


def test_aider_cold_and_again_after_restart(served: Served, project: Path, tmp_path: Path) -> None:
    aider = str(venv_client("aider", "aider"))
    home = tmp_path / "home"
    home.mkdir()
    (home / ".aider.conf.yml").write_text(AIDER_CONF, encoding="utf-8")
    (home / ".aider.model.metadata.json").write_text(json.dumps(METADATA), encoding="utf-8")
    env = client_env(home, OLLAMA_API_BASE=served.url, LITELLM_LOCAL_MODEL_COST_MAP="True")
    assert pinned_pip_version("aider", "aider-chat") in version_of([aider, "--version"], env)

    ask = [aider, "--yes-always", "--message", "What does greet.py do?", "greet.py"]
    cold = run_turn(served, ask, cwd=project, env=env)
    assert any(r.path == "/api/chat" for r in cold.answered), cold

    served.restart()
    again = run_turn(served, ask, cwd=project, env=env)
    assert again.share >= 0.90, again
