"""What a killed save leaves, and a disk with no room: found, removed or used, and said.

A save killed between writing its temp file and renaming it leaves ``tmp/*.tmp``
holding a document's tokens: ``forget`` removes it, ``gc`` at once (no living
writer holds its lock), ``repair`` puts the whole block file in place and
indexes it; a living writer's temp file is left alone. A prefill that can save
nothing exits 1 with the reason; on a full disk every read-only command works.
Each step is a real ``localkv`` process on the tiny model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.tinymodels import TinyModels

LIVENESS_S = 120  # far beyond what any of these takes; only a hang reaches it
KILLED_SAVE = "before_rename:kill@2"  # the 2nd block's temp file is written, not renamed


@pytest.fixture()
def env(tmp_path: Path, tiny_models: TinyModels) -> dict[str, str]:
    return {
        **os.environ,
        "LOCALKV_MODEL": str(tiny_models.base),
        "LOCALKV_HOME": str(tmp_path / "cache"),
    }


@pytest.fixture()
def doc(tmp_path: Path, long_text: str) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text(long_text[:6000], encoding="utf-8")
    return path


def _localkv(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "localkv", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=LIVENESS_S,
        stdin=subprocess.DEVNULL,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


def _json(env: dict[str, str], *args: str) -> dict[str, object]:
    done = _localkv(env, *args, "--json")
    assert done.returncode == 0, done.stderr
    out: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return out


def _killed_save(env: dict[str, str], doc: Path) -> Path:
    """A prefill SIGKILLed with its 2nd block in ``tmp/``; the cache root."""
    done = _localkv({**env, "LOCALKV_FAULT": KILLED_SAVE}, "prefill", "--threads", "1", str(doc))
    assert done.returncode == -9, done.stderr
    root = Path(env["LOCALKV_HOME"])
    assert len(list((root / "tmp").iterdir())) == 1
    assert len(list(root.glob("blocks/*/*.lkv"))) == 1
    return root


def test_forget_removes_a_killed_saves_temp_file(env: dict[str, str], doc: Path) -> None:
    root = _killed_save(env, doc)
    report = _json(env, "cache", "forget", str(doc), "--with-conversations")
    assert report["blocks"] == 1 and report["unindexed_files"] == 1
    assert list((root / "tmp").iterdir()) == []
    assert list(root.glob("blocks/*/*")) == []


def test_gc_removes_a_killed_saves_temp_file_at_once(env: dict[str, str], doc: Path) -> None:
    root = _killed_save(env, doc)
    report = _json(env, "cache", "gc")
    assert report["temp_files"] == 1
    assert list((root / "tmp").iterdir()) == []


def test_repair_indexes_the_whole_block_a_killed_save_left(env: dict[str, str], doc: Path) -> None:
    root = _killed_save(env, doc)
    report = _json(env, "cache", "repair")
    assert report["temp_files"] == 1 and report["placed_from_temp"] == 1
    assert report["blocks_added"] == 1  # the first block had its row already
    assert list((root / "tmp").iterdir()) == []
    answer = _json(env, "ask", "--threads", "1", "--max-tokens", "2", str(doc), "Why?")
    tokens, cache = answer["tokens"], answer["cache"]
    assert isinstance(tokens, dict) and isinstance(cache, dict)
    assert tokens["reused"] == 512 and cache["verified"] is True


_WRITER = """
import sys
from pathlib import Path
from localkv.storage.disk import locked_temp_file
from localkv.storage.paths import prepare_root
with locked_temp_file(prepare_root(Path(sys.argv[1])), "block.lkv") as (path, fd):
    print(path, flush=True)
    sys.stdin.read()
"""


def test_gc_and_forget_leave_a_living_writers_temp_file(env: dict[str, str], doc: Path) -> None:
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, env["LOCALKV_HOME"]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        staged = Path(writer.stdout.readline().strip())
        assert _json(env, "cache", "gc")["temp_files"] == 0
        assert _json(env, "cache", "forget", str(doc))["unindexed_files"] == 0
        assert staged.is_file()
    finally:
        writer.communicate("", timeout=LIVENESS_S)
    assert not staged.exists()  # its writer removed it


# ------------------------------------------------------------- no room
def test_a_prefill_that_can_save_nothing_fails_with_the_reason(
    env: dict[str, str], doc: Path
) -> None:
    full = {**env, "LOCALKV_MIN_FREE": "1000T"}  # more than any disk: no block fits
    done = _localkv(full, "prefill", "--threads", "1", str(doc))
    assert done.returncode == 1
    assert "Error: not saved: [Errno 28]" in done.stderr and "LOCALKV_MIN_FREE" in done.stderr
    assert "the cache holds 0 of its" in done.stderr and "no snapshot" in done.stderr
    assert done.stderr.count("could not save the prefix cache") <= 2  # not one per block
    report = _localkv(full, "prefill", "--threads", "1", "--json", str(doc))
    assert report.returncode == 1
    assert json.loads(report.stdout.splitlines()[-1])["error"].startswith("not saved:")


_FULL_DISK = """
set -e
mount -t tmpfs -o size=32m tmpfs "$ROOT"
export LOCALKV_HOME="$ROOT/cache" LOCALKV_MIN_FREE=16M
"$PY" -m localkv prefill --threads 1 --label notes "$DOC" >/dev/null 2>&1
printf 'Hello\\n' | "$PY" -m localkv chat --plain --threads 1 --max-tokens 2 >/dev/null 2>&1
dd if=/dev/zero of="$ROOT/fill" bs=64k 2>/dev/null || true
dd if=/dev/zero of="$ROOT/fill2" bs=1k 2>/dev/null || true
for cmd in "cache ls --json" "cache stats --json" "cache verify --json" "history ls --json"; do
    set +e; out=$("$PY" -m localkv $cmd 2>&1); rc=$?; set -e
    printf '%s\\t%s\\t%s\\n' "$cmd" "$rc" "$(printf '%s' "$out" | tr '\\n\\t' '  ')"
done
set +e; out=$("$PY" -m localkv prefill --threads 1 "$DOC" 2>&1); rc=$?
printf 'prefill\\t%s\\t%s\\n' "$rc" "$(printf '%s' "$out" | tr '\\n\\t' '  ')"
"""


def _in_own_mount_namespace() -> list[str] | None:
    """How to run a command where mounting a tmpfs is allowed and seen by it alone."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return None
    for prefix in (["unshare", "--mount"], ["unshare", "--mount", "--map-root-user"]):
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=LIVENESS_S)
        if probe.returncode == 0:
            return prefix
    return None


def test_read_only_commands_work_on_a_full_disk(
    env: dict[str, str], doc: Path, tmp_path: Path
) -> None:
    prefix = _in_own_mount_namespace()
    if prefix is None:
        pytest.skip("no mount namespace here (unshare): cannot make a full disk")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run_env = {**env, "ROOT": str(mnt), "PY": sys.executable, "DOC": str(doc)}
    done = subprocess.run(
        [*prefix, "sh", "-c", textwrap.dedent(_FULL_DISK)],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=4 * LIVENESS_S,
    )
    assert done.returncode == 0, done.stderr
    results = {
        cmd: (int(rc), out)
        for cmd, rc, out in (line.split("\t", 2) for line in done.stdout.splitlines())
    }
    labels = [s["label"] for s in json.loads(results["cache ls --json"][1])]
    assert results["cache ls --json"][0] == 0 and "notes" in labels, results
    assert results["cache stats --json"][0] == 0, results
    assert results["cache verify --json"][0] == 0, results
    history = results["history ls --json"]
    assert history[0] == 0 and [c["title"] for c in json.loads(history[1])] == ["Hello"]
    rc, out = results["prefill"]
    assert rc == 1 and "its disk is full" in out and "disk I/O error" not in out, out
