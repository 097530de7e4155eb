"""The warm first token in every face, idle and under load, beside llama-cpp-python's own paths.

    .venv/bin/python benchmarks/faces.py --peer-python PY [--model PATH] [--tokens 2000]
        [--runs 5] [--load 2] [--load-group same|own] [--localkv-python PY --label NAME] [--no-peer]
        [--out FIGURES.json] [--write-docs docs/performance/faces.md]
    .venv/bin/python benchmarks/faces.py --render A.json [B.json ...]
        --write-docs docs/performance/faces.md

``--peer-python`` is a Python with ``llama-cpp-python[server]==0.3.36`` (its
server's extras conflict with localkv's pinned Starlette, so it lives in its own
virtual environment). ``--localkv-python`` measures another checkout's localkv
(its own venv's Python, e.g. an earlier commit) under ``--label``.

Two documents of about ``--tokens`` tokens (the bench text) are cached once, in a
fresh cache for localkv and as llama.cpp state files for the peer. Then, idle and
with ``--load`` CPU-bound processes (``python -c 'while 1: pass'``, nice 0) on the
machine, ``--runs`` times each, localkv and the peer in turn:

- ``ask``: a fresh process answers a new question about document A (localkv:
  ``localkv ask``; the peer: ``faces_peer.py ask``, which loads the model, loads
  the state file with ``llama_state_seq_load_file`` and decodes the question).
  Seconds from starting the command to the first byte of the answer on its stdout.
- ``ask-repeat`` (localkv only): the same, asking one question again and again,
  so the cache holds the whole prompt (the first run is not counted).
- ``api``: one process that has loaded the model answers about A, then B, in turn,
  so each answer restores (``Runtime.ask`` / ``llama_state_seq_load_file``).
  Seconds from the call to the first token.
- ``http-restart``: the server is started again, then a streamed chat completion
  about A is sent (localkv serve from its disk cache; the peer is
  ``llama_cpp.server --cache True --cache_type disk``, its own persistent cache).
  Seconds from sending to the first content chunk.
- ``http-repeat``: the same request again, to the same server.
- ``floor-1`` and ``floor-all`` (the machine): fixed CPU work (a Python loop) in one
  process, and in one process per core, timed to the end of the last. Their busy / idle
  ratios are what the scheduler gives work under that load: work on one thread
  cannot do better than ``floor-1``'s, work spread over every core idle, a thread a
  core, no better than ``floor-all``'s.

``--load-group`` says where the CPU-bound processes run: ``same`` (the default) in the
bench's own session, beside localkv's processes, so the kernel shares the cores among
their threads; ``own`` in a session of their own, as another program on a desktop is
(with the kernel's session autogroup on, or a desktop's per-application groups, the
cores are shared between the groups first).

Both sides use the same model, n_ctx and flash attention (``--flash-attn``, off by
default: what localkv's ``auto`` is on a CPU at this size); the peer's prompt is the
token ids localkv builds. The peer runs with every core; localkv with its default,
one thread per core the other work leaves free (``localkv.model.threads.ThreadFit``), unless
``--threads N`` sets both. Neither has OpenMP variables set
by the bench: localkv chooses its wait policy from the load, the peer runs with
libgomp's defaults. Medians per face and load; every run and the load average
when it began are in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, cast

HERE = Path(__file__).resolve().parent
SYSTEM = "Answer from the document."
HTTP_QUESTION = "Who is in the story, in one sentence?"
MAX_TOKENS = 16
FACES = ("ask", "ask-repeat", "api", "http-restart", "http-repeat")
# The floors: fixed CPU work (about 0.18 s of one idle core here) in one process and in one
# per core: the busy / idle ratios the scheduler gives such work, a thread a core.
FLOORS = ("floor-1", "floor-all")
FLOOR_SPIN = 6_000_000


def question(i: int) -> str:
    """A question that no earlier run asked, so each answer decodes its own tokens."""
    return f"Question {i}: who is in the story, in one sentence?"


# ------------------------------------------------------------------ set-up
def _documents(model: Path, n: int, work: Path) -> dict[str, Path]:
    from localkv.bench.text import prompt_tokens
    from localkv.model.session import ModelSession, SessionConfig

    paths = {}
    with ModelSession(SessionConfig(model_path=model, n_ctx=n + 512)) as s:
        text = s.detokenize(prompt_tokens(s, 2 * n))
        for name, part in (("A", text[: len(text) // 2]), ("B", text[len(text) // 2 :])):
            paths[name] = work / f"doc-{name}.txt"
            paths[name].write_text(f"Notes {name}.\n\n{part}", encoding="utf-8")
    return paths


def _prompts(args: argparse.Namespace, docs: dict[str, Path], work: Path, n: int) -> Path:
    """localkv's token ids of each document's prompt and questions, for the peer."""
    import localkv

    opts = {"n_ctx": args.ctx, "n_threads": args.threads, "flash_attn": args.flash_attn}
    rt = localkv.Runtime.open(args.model, use_cache=False, **opts)
    out: dict[str, Any] = {}
    with rt:
        for name, path in docs.items():
            doc = localkv.read_document(path)
            asks = [rt.build([doc], system=SYSTEM, question=question(i)).tokens for i in range(n)]
            k = 0
            while all(len(t) > k and t[k] == asks[0][k] for t in asks):
                k += 1
            out[name] = {"prefix": asks[0][:k], "questions": [t[k:] for t in asks]}
    path = work / "prompts.json"
    threads = args.threads or len(os.sched_getaffinity(0))
    settings = {"model": str(args.model), "n_ctx": args.ctx, "threads": threads}
    settings |= {"flash_attn": args.flash_attn == "on", "max_tokens": MAX_TOKENS, "work": str(work)}
    path.write_text(json.dumps({**settings, "docs": out}))
    return path


# ------------------------------------------------------------------ measures
def first_byte(cmd: list[str], env: dict[str, str], log: Path) -> float:
    """Seconds from starting ``cmd`` to the first byte on its stdout; it must then succeed.

    It runs in the log's folder: a checkout's own folder would put that checkout's
    code first on ``sys.path``."""
    with log.open("ab") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, cwd=log.parent)
        assert proc.stdout is not None
        got = proc.stdout.read(1)
        first = time.perf_counter() - t0
        proc.stdout.read()
        if proc.wait(600) != 0 or not got:
            raise RuntimeError(f"{cmd[:4]} failed (rc {proc.returncode}); see {log}")
    return first


API_WORKER = """
import json, sys, time
import localkv
p = json.loads(sys.argv[1])
rt = localkv.Runtime.open(p["model"], n_ctx=p["n_ctx"], n_threads=p["threads"], flash_attn=p["fa"])
docs = [localkv.read_document(d) for d in p["docs"]]
params = localkv.SamplingParams(temperature=0, max_tokens=p["max_tokens"])
out = []
with rt:
    for i in range(p["runs"]):
        first = []
        t0 = time.perf_counter()
        rt.ask([docs[i % 2]], p["questions"][i], system=p["system"], params=params,
               on_text=lambda piece: first or first.append(time.perf_counter() - t0))
        out.append(first[0])
        rt.wait_for_saves()
import os
from localkv.model import native
omp = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
print(json.dumps({"ttft_s": out, "openmp": getattr(native, "WAIT_CHOICE", None), **omp}))
"""


class Server:
    """``localkv serve`` or ``llama_cpp.server`` (with its disk cache), restartable."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str], health: str) -> None:
        from support.server import free_port  # tests/support

        self.port = free_port()
        self.cmd = [*cmd, "--port", str(self.port)]
        self.cwd, self.env, self.health = cwd, env, health
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = (self.cwd / "server.log").open("ab")
        self.proc = subprocess.Popen(
            self.cmd, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        wait_ready(self.proc, f"http://127.0.0.1:{self.port}{self.health}", self.cwd / "server.log")

    def stop(self) -> None:
        stop_server(self.proc)

    def ttft(self, system: str) -> float:
        first, _ = stream_ttft(self.port, system, HTTP_QUESTION)
        if not first:
            raise RuntimeError(f"no content from {self.cmd[:4]}")
        return first


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Until ``url`` answers 200; an error if the server exits first."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)


def stop_server(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(300)


def stream_ttft(port: int, system: str, question: str) -> tuple[float, dict[str, object]]:
    """Seconds from sending a streamed chat completion to its first content chunk (0: none),
    and the last ``localkv`` object the stream carried (localkv's servers only)."""
    import httpx

    body = {
        "model": "m",
        "temperature": 0,
        "max_tokens": 8,
        "stream": True,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    first, extra = 0.0, {}
    t0 = time.perf_counter()
    with httpx.stream("POST", url, json=body, timeout=1200) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if not first and delta.get("content"):
                first = time.perf_counter() - t0
            extra = chunk.get("localkv", extra)
    return first, extra


BYTECODE_CHECK = """
import importlib.util, json, os, sys
spec = importlib.util.find_spec
dirs = [*spec("localkv").submodule_search_locations]
for sub in ("localkv.storage", "localkv.tui"):
    found = spec(sub)
    if found is not None:
        dirs += [d for d in found.submodule_search_locations if d not in dirs]
fresh = total = 0
for top in dirs:
    for root, _, files in os.walk(top):
        for name in (f for f in files if f.endswith(".py")):
            src = os.path.join(root, name)
            total += 1
            try:
                with open(importlib.util.cache_from_source(src), "rb") as f:
                    head = f.read(16)
            except OSError:
                continue
            st = os.stat(src)
            flags, mtime, size = (int.from_bytes(head[i:i + 4], "little") for i in (4, 8, 12))
            same = mtime == int(st.st_mtime) & 0xFFFFFFFF and size == st.st_size & 0xFFFFFFFF
            fresh += head[:4] == importlib.util.MAGIC_NUMBER and flags == 0 and same
writes = not (sys.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE"))
print(json.dumps({"fresh": fresh, "modules": total, "write": writes}))
"""


def bytecode(python: str, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """How many of localkv's modules ``python`` loads from cached bytecode, and whether it writes
    it: a process that compiles ~80 modules from source before its first token pays ~0.1 s that a
    pip-installed (or once-run) localkv does not (``make`` compiles them)."""
    out = subprocess.run([python, "-c", BYTECODE_CHECK], env=env, cwd=cwd, capture_output=True)
    return cast(dict[str, Any], json.loads(out.stdout)) if out.returncode == 0 else {}


# ------------------------------------------------------------------ the run
class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
        self.env["LOCALKV_HOME"] = str(work / "localkv-home")
        self.docs = _documents(args.model, args.tokens, work)
        self.asked = 0  # questions used so far (each run asks a new one)
        self.n_questions = (8 + 8 * args.api_rounds) * args.runs
        self.http = bool({"http-restart", "http-repeat"} & set(args.faces))
        self.prompts = _prompts(args, self.docs, work, self.n_questions) if args.peer else None
        self.system_a = f"{SYSTEM}\n\n{self.docs['A'].read_text(encoding='utf-8')}"
        common = ["--ctx", str(args.ctx), "--flash-attn", args.flash_attn]
        common += ["--threads", str(args.threads)] if args.threads else []
        self.common = ["--model", str(args.model), *common]

    def lkv(self, *rest: str) -> list[str]:
        return [self.args.localkv_python, "-m", "localkv", *rest]

    def peer(self, *rest: str) -> list[str]:
        return [self.args.peer_python, str(HERE / "faces_peer.py"), *rest]

    def setup(self) -> None:
        for d in self.docs.values():
            cmd = self.lkv("prefill", *self.common, "--system", SYSTEM, str(d))
            subprocess.run(cmd, env=self.env, cwd=self.work, check=True, capture_output=True)
        if self.prompts:
            subprocess.run(self.peer("save", str(self.prompts)), env=self.env, check=True)
        for server in self.servers().values() if self.http else ():  # first request: cold prefill
            server.start()
            server.ttft(self.system_a)
            server.stop()

    def servers(self) -> dict[str, Server]:
        home = self.work / "localkv-http"
        home.mkdir(exist_ok=True)
        env = {**self.env, "LOCALKV_HOME": str(home)}
        out = {"localkv": Server(self.lkv("serve", *self.common), home, env, "/health")}
        if self.args.peer:
            peer_dir = self.work / "peer-http"
            peer_dir.mkdir(exist_ok=True)
            a = self.args
            cmd = [a.peer_python, "-m", "llama_cpp.server", "--model", str(a.model)]
            threads = str(a.threads or len(os.sched_getaffinity(0)))
            cmd += ["--host", "127.0.0.1", "--n_ctx", str(a.ctx), "--n_threads", threads]
            cmd += ["--n_threads_batch", threads, "--flash_attn", str(a.flash_attn == "on")]
            cmd += ["--cache", "True", "--cache_type", "disk"]
            out["peer"] = Server(cmd, peer_dir, self.env, "/v1/models")
        return out

    def ask(self, who: str, again: bool = False) -> float:
        i = -1 if again else self.asked
        self.asked += 0 if again else 1
        log = self.work / f"{who}-ask.log"
        if who == "localkv":
            cmd = self.lkv("ask", *self.common, "--system", SYSTEM, "--temperature", "0")
            cmd += ["--max-tokens", str(MAX_TOKENS), str(self.docs["A"]), question(i)]
            return first_byte(cmd, self.env, log)
        return first_byte(self.peer("ask", str(self.prompts), "A", str(i)), self.env, log)

    def api(self, who: str, runs: int) -> list[float]:
        base = self.asked
        self.asked += runs
        if who == "localkv":
            p = {"model": str(self.args.model), "n_ctx": self.args.ctx, "runs": runs}
            p |= {"threads": self.args.threads, "max_tokens": MAX_TOKENS, "system": SYSTEM}
            p["fa"] = self.args.flash_attn
            p |= {"docs": [str(self.docs["A"]), str(self.docs["B"])]}
            p["questions"] = [question(base + i) for i in range(runs)]
            cmd = [self.args.localkv_python, "-c", API_WORKER, json.dumps(p)]
        else:  # the peer's questions are token ids: index ``base + i`` of each document's
            cmd = self.peer("api", str(self.prompts), str(runs), str(base))
        done = subprocess.run(
            cmd, env=self.env, cwd=self.work, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        return cast(list[float], json.loads(done.stdout.strip().splitlines()[-1])["ttft_s"])

    def load_phase(self, spinners: int) -> dict[str, Any]:
        who = ["localkv", "peer"] if self.args.peer else ["localkv"]
        runs: dict[str, dict[str, list[dict[str, float]]]] = {
            f: {w: [] for w in who} for f in FACES
        }

        def note(face: str, w: str, seconds: float, load: float) -> None:
            runs[face][w].append({"s": seconds, "load1": load})
            print(
                f"  +{spinners} {face:12} {w:8} {seconds * 1000:8.0f} ms  load {load:.2f}",
                flush=True,
            )

        faces = self.args.faces
        for _ in range(self.args.runs if "ask" in faces else 0):
            for w in who:
                load = os.getloadavg()[0]
                note("ask", w, self.ask(w), load)
        if "ask-repeat" in faces:
            self.ask("localkv", again=True)  # the question's own block, cached
        for _ in range(self.args.runs if "ask-repeat" in faces else 0):
            load = os.getloadavg()[0]
            note("ask-repeat", "localkv", self.ask("localkv", again=True), load)
        for _ in range(self.args.api_rounds if "api" in faces else 0):
            for w in who:  # a process each, in turn
                load = os.getloadavg()[0]
                for s in self.api(w, 2 * self.args.runs)[1:]:  # the first restores cold
                    note("api", w, s, load)
        servers = self.servers()
        for _ in range(self.args.runs if self.http else 0):
            for w, server in servers.items():
                server.start()
                try:
                    load = os.getloadavg()[0]
                    note("http-restart", w, server.ttft(self.system_a), load)
                    note("http-repeat", w, server.ttft(self.system_a), os.getloadavg()[0])
                finally:
                    server.stop()
        return runs

    def floor_phase(self, spinners: int) -> dict[str, Any]:
        """The floors: the same CPU work on one thread and on every core, under this load."""
        cores = len(os.sched_getaffinity(0))
        out: dict[str, dict[str, list[dict[str, float]]]] = {}
        for face, procs in (("floor-1", 1), ("floor-all", cores)):
            out[face] = {"machine": []}
            for _ in range(self.args.runs):
                load = os.getloadavg()[0]
                seconds = floor(FLOOR_SPIN, procs)
                out[face]["machine"].append({"s": seconds, "load1": load})
                print(f"  +{spinners} {face:12} machine  {seconds * 1000:8.0f} ms", flush=True)
        return out


SPIN = "import os\nfor _ in range({}):\n    if os.fork() == 0:\n        break\nwhile 1: pass"


def _spin(n: int, own_session: bool) -> subprocess.Popen[bytes] | None:
    """``n`` CPU-bound processes (one and the ``n - 1`` it forks), in the bench's session or,
    with ``own_session``, together in a session of their own, as another program on a desktop
    is (where the kernel groups by session, CPU time is shared between the groups first, then
    between a group's threads). The first leads their process group."""
    if n == 0:
        return None
    cmd = [sys.executable, "-c", SPIN.format(n - 1)]
    if own_session:
        return subprocess.Popen(cmd, start_new_session=True)
    return subprocess.Popen(cmd, process_group=0)


def _stop_spin(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _busy_loop(n: int) -> None:
    x = 0
    for i in range(n):
        x += i


def floor(spin: int, procs: int) -> float:
    """Seconds for ``procs`` processes (forked, one per core at most) to each run ``spin``
    steps of one Python thread's CPU work: the machine's own figure for fixed CPU work, in
    the bench's own scheduling place (where localkv's processes run)."""
    t0 = time.perf_counter()
    kids = []
    for _ in range(procs):
        pid = os.fork()
        if pid == 0:
            try:
                _busy_loop(spin)
            finally:
                os._exit(0)
        kids.append(pid)
    for pid in kids:
        os.waitpid(pid, 0)
    return time.perf_counter() - t0


def _autogroup() -> str:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        return "absent"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="localkv-faces-"))
    try:
        bench = Bench(args, work)
        bench.setup()
        compiled = bytecode(args.localkv_python, bench.env, work)
        phases = {}
        for spinners in (0, args.load):
            spin = _spin(spinners, args.load_group == "own")
            try:
                phases[str(spinners)] = bench.load_phase(spinners)
                phases[str(spinners)] |= bench.floor_phase(spinners)
            finally:
                _stop_spin(spin)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "label": args.label,
        "tokens": args.tokens,
        "runs": args.runs,
        "load": args.load,
        "load_group": args.load_group,
        "api_rounds": args.api_rounds,
        "autogroup": _autogroup(),
        "ctx": args.ctx,
        "threads": args.threads,
        "flash_attn": args.flash_attn,
        "cpus": len(os.sched_getaffinity(0)),
        "when": time.strftime("%Y-%m-%dT%H:%M%z"),
        "command": " ".join(["benchmarks/faces.py", *sys.argv[1:]]),
        "bytecode": compiled,
        "phases": phases,
    }


# ------------------------------------------------------------------ the page
def _med(runs: list[dict[str, float]], key: str = "s") -> float:
    return statistics.median(r[key] for r in runs)


def _ms(s: float) -> str:
    return f"{s * 1000:,.0f} ms"


def _threads_text(data: dict[str, Any]) -> str:
    if data.get("threads"):
        return f"{data['threads']} threads"
    return "the peer with every core, localkv one thread per core the other work leaves"


def _rounds_text(data: dict[str, Any]) -> str:
    rounds = data.get("api_rounds", 1)
    if rounds == 1:
        return ""
    counted = 2 * data["runs"] - 1
    return f" (api: {rounds} processes a side in turn, {counted} questions counted in each)"


def _group_text(data: dict[str, Any]) -> str:
    group = data.get("load_group")
    if group is None:
        return ""
    where = "in a session of their own" if group == "own" else "in the bench's session"
    return f" {where} (the kernel's session autogroup: {data.get('autogroup', '?')})"


def _bytecode_line(found: dict[str, Any] | None) -> str:
    if not found:
        return ""
    return (
        f" localkv's modules from cached bytecode: {found['fresh']} of {found['modules']}"
        f" (Python {'writes' if found['write'] else 'does not write'} it)."
    )


def render(sets: list[dict[str, Any]]) -> str:
    """Markdown: per face, idle and busy medians, their ratio, and localkv against the peer."""
    lines = [
        "# The warm first token in every face",
        "",
        "<!-- Generated by benchmarks/faces.py; do not edit by hand. -->",
        "",
        str(cast(str, __doc__).split("\n\n", 3)[3].split("\n\nBoth sides")[0]).strip(),
        "",
    ]
    for data in sets:
        busy = str(data["load"])
        lines += [
            f"## {data['label']}: {data['tokens']:,}-token documents, {data['when']}",
            "",
            "```",
            str(data["command"]),
            "```",
            "",
            f"{data['runs']} runs per face and load{_rounds_text(data)}, medians; "
            f"n_ctx {data['ctx']}, "
            f"{_threads_text(data)} on {data['cpus']} usable cores, flash attention "
            f"{data.get('flash_attn', 'on')}; busy = "
            f"{busy} CPU-bound processes{_group_text(data)}. `load` is the median 1-minute "
            "load average when the runs began (idle and busy)."
            f"{_bytecode_line(data.get('bytecode'))}",
            "",
            "| face | who | idle | busy | busy / idle | load |",
            "|---|---|---:|---:|---:|---|",
        ]
        idle_p, busy_p = data["phases"]["0"], data["phases"][busy]
        for face in (f for f in (*FACES, *FLOORS) if f in idle_p and f in busy_p):
            for who, idle in idle_p[face].items():
                hot = busy_p[face][who]
                if not idle or not hot:
                    continue
                ratio = _med(hot) / _med(idle)
                loads = f"{_med(idle, 'load1'):.1f} / {_med(hot, 'load1'):.1f}"
                lines.append(
                    f"| {face} | {who} | {_ms(_med(idle))} | {_ms(_med(hot))} "
                    f"| {ratio:.2f}x | {loads} |"
                )
        if "peer" in idle_p["ask"]:
            lines += ["", "localkv against the peer (its median over localkv's):", ""]
            lines += ["| face | idle | busy |", "|---|---:|---:|"]
            for face in (f for f in FACES if idle_p[f].get("peer")):
                r0 = _med(idle_p[face]["peer"]) / _med(idle_p[face]["localkv"])
                r1 = _med(busy_p[face]["peer"]) / _med(busy_p[face]["localkv"])
                lines.append(f"| {face} | {r0:.2f}x | {r1:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=cast(str, __doc__).splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--load", type=int, default=2)
    ap.add_argument(
        "--load-group",
        choices=("same", "own"),
        default="same",
        help="the CPU-bound processes in the bench's session (same) or their own (own)",
    )
    ap.add_argument("--threads", type=int, help="both sides' threads (default: see above)")
    ap.add_argument(
        "--faces",
        type=lambda v: v.split(","),
        default=list(FACES),
        help=f"comma-separated faces to measure (default: all of {','.join(FACES)})",
    )
    ap.add_argument(
        "--api-rounds",
        type=int,
        default=1,
        help="api: processes per side, in turn (each asks 2 x --runs questions)",
    )
    # off: what localkv's auto chooses on a CPU at this size (loading.flash_attn_setting)
    ap.add_argument("--flash-attn", choices=("on", "off"), default="off")
    ap.add_argument("--peer-python", help="a Python with llama-cpp-python[server]")
    ap.add_argument("--no-peer", dest="peer", action="store_false")
    ap.add_argument("--localkv-python", default=sys.executable)
    ap.add_argument("--label", default="localkv")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--write-docs", type=Path)
    ap.add_argument("--render", type=Path, nargs="+", help="write the page from saved figures")
    args = ap.parse_args()
    if args.render:
        sets = [json.loads(p.read_text()) for p in args.render]
        args.write_docs.write_text(render(sets))
        return
    if unknown := set(args.faces) - set(FACES):
        ap.error(f"no such face: {', '.join(sorted(unknown))}")
    if args.peer and not args.peer_python:
        ap.error("--peer-python is needed (or --no-peer)")
    sys.path.insert(0, str(HERE.parent / "tests"))
    sys.path.insert(0, str(HERE.parent))
    from localkv.model.find import resolve_model

    args.model = resolve_model(args.model)
    args.ctx = (args.tokens + 512 + 255) // 256 * 256
    data = measure(args)
    if args.out:
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    if args.write_docs:
        args.write_docs.write_text(render([data]))


if __name__ == "__main__":
    main()
