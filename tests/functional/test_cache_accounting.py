"""What ``localkv cache`` counts: sizes that add up, and removals that say what they remove.

Through the CLI on the tiny model, with a real cache on disk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from support.tinymodels import TinyModels

from localkv.cache.budgeting import human_size
from localkv.cli import cli


@pytest.fixture()
def env(tmp_path: Path, tiny_models: TinyModels) -> dict[str, str]:
    return {
        **os.environ,
        "LOCALKV_MODEL": str(tiny_models.base),
        "LOCALKV_HOME": str(tmp_path / "cache"),
        "LOCALKV_OTHER_TASKS": "0",
    }


def _run(env: dict[str, str], *args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args), env=env)
    assert result.exit_code == code, result.output + result.stderr
    return result.stdout


def _json(env: dict[str, str], *args: str) -> Any:
    return json.loads(_run(env, *args, "--json").strip().splitlines()[-1])


def _stored(env: dict[str, str]) -> int:
    return int(_json(env, "cache", "stats")["budget"]["stored_bytes"])


def _two_sharing_a_prefix(env: dict[str, str], tmp_path: Path, text: str) -> dict[str, Any]:
    """``head`` alone, then ``head`` and ``tail``: the second chain begins with the first's
    whole blocks. The rows of ``cache ls --json`` by label."""
    head, tail = tmp_path / "head.txt", tmp_path / "tail.txt"
    head.write_text(text[:4000], encoding="utf-8")
    tail.write_text(text[4000:6000], encoding="utf-8")
    _run(env, "prefill", "--threads", "1", "--label", "head", str(head))
    _run(env, "prefill", "--threads", "1", "--label", "both", str(head), str(tail))
    return {r["label"]: r for r in _json(env, "cache", "ls")}


def test_cache_ls_rows_say_what_rm_frees_and_the_total_is_what_stats_stores(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    rows = _two_sharing_a_prefix(env, tmp_path, long_text)
    stored = _stored(env)
    full = sum(r["bytes_on_disk"] for r in rows.values())
    assert full > stored  # the shared blocks are in both chains
    frees = {label: r["frees_bytes"] for label, r in rows.items()}
    assert 0 < frees["head"] < rows["head"]["bytes_on_disk"]
    assert sum(frees.values()) < stored
    listing = _run(env, "cache", "ls")
    total = " ".join(listing.split("\ntotal ")[-1].split())
    assert total.startswith(f"{human_size(stored)} on disk: "), listing
    assert "shared by rows" in total
    assert "frees" in listing.splitlines()[1]  # the column's header

    removed = _json(env, "cache", "rm", rows["head"]["id"])
    after = _stored(env)
    assert removed["bytes_freed"] == frees["head"] == stored - after
    (left,) = _json(env, "cache", "ls")  # alone now, it frees its whole chain
    assert left["frees_bytes"] == left["bytes_on_disk"] == after
    assert (
        _run(env, "cache", "ls")
        .strip()
        .splitlines()[-1]
        .startswith(f"total {human_size(after)} on disk: {human_size(after)} the rows free")
    )
    removed = _json(env, "cache", "rm", left["id"])
    assert removed["bytes_freed"] == after and _stored(env) == 0


def test_forget_names_each_snapshot_it_removes_and_marks_the_pinned(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    quoted = "The lighthouse keeper wrote every night that the sea was calm and grey."
    secret, quoting, pinned, other = (tmp_path / f"{n}.txt" for n in "abcd")
    opening = "Private notes, kept in a drawer: the ferry leaves at dawn on Tuesdays."
    secret.write_text(f"{opening}\n{quoted}\n", encoding="utf-8")  # never cached
    quoting.write_text(f"{long_text[1000:1400]}\n{quoted}\n{long_text[1400:1600]}", "utf-8")
    pinned.write_text(f"{long_text[2000:2300]}\n{quoted}\n", encoding="utf-8")
    other.write_text(long_text[3000:3600], encoding="utf-8")
    _run(env, "prefill", "--threads", "1", str(quoting))
    _run(env, "prefill", "--threads", "1", "--pin", str(pinned))
    _run(env, "prefill", "--threads", "1", str(other))
    ids = {r["label"]: r["id"] for r in _json(env, "cache", "ls")}

    said = _run(env, "cache", "forget", str(secret))
    lines = said.splitlines()
    assert lines[0].startswith("forgot 2 snapshot(s)"), said
    named = {line.split()[1]: line for line in lines[1:]}
    assert set(named) == {ids["b.txt"], ids["c.txt"]}, said
    assert "b.txt: its blocks quote a.txt" in named[ids["b.txt"]]
    assert "c.txt (pinned): its blocks quote a.txt" in named[ids["c.txt"]]
    assert [r["label"] for r in _json(env, "cache", "ls")] == ["d.txt"]


def test_forget_json_lists_the_removed_snapshots_with_their_pins_and_why(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    doc = tmp_path / "notes.txt"
    doc.write_text(long_text[:1200], encoding="utf-8")
    _run(env, "prefill", "--threads", "1", "--pin", str(doc))
    (snap,) = _json(env, "cache", "ls")
    report = _json(env, "cache", "forget", str(doc))
    assert report["snapshots"] == [snap["id"]]
    assert report["removed"] == [
        {"id": snap["id"], "label": "notes.txt", "pinned": True, "why": "source"}
    ]


def test_verify_deep_counts_the_snapshots_of_other_models_it_skips(
    env: dict[str, str], tmp_path: Path, tiny_models: TinyModels, long_text: str
) -> None:
    doc = tmp_path / "notes.txt"
    doc.write_text(long_text[:1200], encoding="utf-8")
    other = ["--model", str(tiny_models.other_weights)]
    _run(env, "prefill", "--threads", "1", str(doc))
    _run(env, "prefill", "--threads", "1", *other, str(doc))
    said = _run(env, "cache", "verify", "--deep", "--threads", "1")
    lines = said.strip().splitlines()
    assert lines[-1] == "all good (1 skipped)", said
    assert lines[-2].startswith("skipped 1 snapshot(s) made with another model or settings")
    assert "1 of tiny-other-weights" in lines[-2]
    report = _json(env, "cache", "verify", "--deep", "--threads", "1")
    (mine,) = report["deep"]
    assert report["ok"] is True and mine["ok"] is True
    assert [s["model"] for s in report["skipped"]] == ["tiny-other-weights"]
    assert report["skipped"][0]["snapshot"] != mine["snapshot"]


def test_repair_of_a_sound_cache_says_nothing_was_reset_and_a_rebuilt_one_that_hits_were(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    doc = tmp_path / "notes.txt"
    doc.write_text(long_text[:1200], encoding="utf-8")
    _run(env, "prefill", "--threads", "1", str(doc))
    _run(env, "prefill", "--threads", "1", str(doc))  # a hit
    said = _run(env, "cache", "repair").strip().splitlines()
    assert said[-1].startswith("nothing was reset"), said
    assert "start again" not in " ".join(said)
    assert _json(env, "cache", "repair")["not_recovered"] is None
    (snap,) = _json(env, "cache", "ls")
    assert snap["hits"] == 1  # as it was

    for name in ("index.db", "index.db-wal", "index.db-shm"):  # lost: rebuilt from the files
        (Path(env["LOCALKV_HOME"]) / name).unlink(missing_ok=True)
    said = _run(env, "cache", "repair").strip().splitlines()
    assert said[-1] == (
        "not recovered: hit counts, last-used times and hit/miss statistics start again"
    )
    (snap,) = _json(env, "cache", "ls")
    assert snap["hits"] == 0
