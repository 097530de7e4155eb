"""Simon Willison's ``llm`` (PyPI ``llm``, pinned, in a virtual environment of its
own) on ``localkv serve``'s OpenAI API.

Set up as the README says: the server as an OpenAI-compatible model in
``extra-openai-models.yaml`` in llm's configuration directory. A cold question
over a long system prompt completes with no error answer; after a restart,
continuing the conversation (``llm -c``) reads at least 90% of its prompt from
disk.
"""

from __future__ import annotations

from pathlib import Path

from agentkit import (
    AGENTS_ONLY,
    REPO,
    Served,
    client_env,
    pinned_pip_version,
    run_turn,
    venv_client,
    version_of,
)

pytestmark = AGENTS_ONLY


def llm_models(served: Served) -> str:
    """The README's ``extra-openai-models.yaml``, exactly."""
    return f"""\
- model_id: localkv
  model_name: local
  api_base: "{served.url}/v1"
"""


def test_llm_cold_and_continued_after_restart(
    served: Served, project: Path, tmp_path: Path
) -> None:
    llm = str(venv_client("llm", "llm"))
    home = tmp_path / "home"
    config = home / ".config" / "io.datasette.llm"
    config.mkdir(parents=True)
    (config / "extra-openai-models.yaml").write_text(llm_models(served), encoding="utf-8")
    env = client_env(home)
    assert pinned_pip_version("llm", "llm") in version_of([llm, "--version"], env)
    notes = (REPO / "examples" / "alice.txt").read_text(encoding="utf-8")

    cold = run_turn(
        served, [llm, "-m", "localkv", "-s", notes, "Who is Alice?"], cwd=project, env=env
    )
    assert [r.path for r in cold.answered] == ["/v1/chat/completions"], cold

    served.restart()
    more = run_turn(served, [llm, "-c", "And her sister?"], cwd=project, env=env)
    assert more.share >= 0.90, more
