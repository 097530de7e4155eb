"""Continue's CLI (npm ``@continuedev/cli``, pinned: ``cn``) on ``localkv serve``'s
OpenAI API.

Set up as the README says: ``~/.continue/config.yaml`` with an ``openai`` model
whose ``apiBase`` is the server, and its self-update switched off (``cn`` runs
``npm i -g`` on itself when a newer release is out). The cold turn (``cn -p``)
completes with no error answer; after a restart, resuming the session (``cn -p
--resume``) reads at least 90% of its prompt from disk.
"""

from __future__ import annotations

import json
from pathlib import Path

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

PACKAGE = "@continuedev/cli"


def continue_config(served: Served) -> str:
    """The README's ``~/.continue/config.yaml``, exactly."""
    return f"""\
name: localkv
version: 1.0.0
schema: v1
models:
  - name: local
    provider: openai
    model: local
    apiBase: {served.url}/v1
    apiKey: none
    roles: [chat, edit, apply]
    defaultCompletionOptions:
      contextLength: {CONTEXT}
"""


def test_continue_cli_cold_and_resumed_after_restart(
    served: Served, project: Path, tmp_path: Path
) -> None:
    cn = str(npm_client("cn"))
    home = tmp_path / "home"
    (home / ".continue" / "index").mkdir(parents=True)
    (home / ".continue" / "config.yaml").write_text(continue_config(served), encoding="utf-8")
    no_update = json.dumps({"autoUpdateCli": False})
    (home / ".continue" / "index" / "globalContext.json").write_text(no_update, encoding="utf-8")
    env = client_env(home, CONTINUE_CLI_ENABLE_TELEMETRY="0")
    assert pinned_npm_version(PACKAGE) in version_of([cn, "--version"], env)

    cold = run_turn(served, [cn, "-p", "What does greet.py do?"], cwd=project, env=env)
    assert [r.path for r in cold.answered] == ["/v1/chat/completions"], cold

    served.restart()
    more = run_turn(served, [cn, "-p", "--resume", "Say it in one word."], cwd=project, env=env)
    assert more.share >= 0.90, more
