"""The model opened beside the command line's imports (``localkv.cli.early``).

``localkv ask`` and ``prefill`` open the model their arguments name in a thread
as the process starts; the command's own ``open_model`` takes that context only
when the configuration it builds from the parsed options is the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from localkv.storage.filehash import FileHasher
from support.tinyarch import TinyArchModels, build_tiny_arch_models
from support.tinymodels import TinyModels, tiny_config

from localkv.cache.identity import Identity, identity_of, probe_kv_layout
from localkv.cli import BLAS_THREADS, early
from localkv.cli.documents import ask, prefill
from localkv.cli.options import session_config
from localkv.model import early_open, native
from localkv.model.early_open import drop_early, open_early, open_model
from localkv.model.session import LoraSpec, ModelSession
from localkv.model.state import STATE_WORK

ARGS = [
    [],
    ["--ctx", "1024"],
    ["--ctx=2048", "--threads", "1"],
    ["--type-k", "Q8_0", "--type-v=q8_0", "--flash-attn", "on"],
    ["--n-gpu-layers", "0", "--flash-attn=off"],
    ["--ctx", "512", "--ctx", "768"],  # the last one given counts, as in click
    ["--system", "--ctx 8", "--json"],  # an option's value is not read as an option
]


@pytest.fixture(autouse=True)
def _nothing_left_open() -> None:
    yield
    drop_early()


@pytest.mark.parametrize("command", [ask, prefill], ids=["ask", "prefill"])
@pytest.mark.parametrize("args", ARGS, ids=[" ".join(a) or "defaults" for a in ARGS])
@pytest.mark.parametrize("named", [False, True], ids=["default-model", "--model"])
def test_the_guess_is_the_config_the_command_builds(
    tiny_models: TinyModels, command: object, args: list[str], named: bool
) -> None:
    model = ["--model", str(tiny_models.base)] if named else []
    argv = [*model, *args, "doc.txt", "question"]
    parsed = command.make_context(command.name, list(argv))  # type: ignore[attr-defined]
    built = session_config(parsed.params)
    guess = early.guess_config([command.name, *argv])  # type: ignore[attr-defined]
    assert guess is not None
    assert dataclasses.replace(guess, chat_template=built.chat_template) == built


@pytest.mark.parametrize(
    "argv",
    [
        ["chat"],
        ["serve"],
        ["ask", "--help"],
        ["ask", "doc.txt", "q", "-h"],
        ["ask", "--ctx", "many", "doc.txt", "q"],
        ["ask", "--model", "/no/such/model.gguf", "doc.txt", "q"],
        ["ask", "doc.txt", "q", "--ctx"],
    ],
)
def test_no_guess_where_the_arguments_make_no_configuration(argv: list[str]) -> None:
    assert early.guess_config(argv) is None


def test_an_equal_configuration_takes_the_early_context(tiny_models: TinyModels) -> None:
    cfg = tiny_config(tiny_models.base)
    assert open_early(cfg)
    opened = early_open._early
    assert opened is not None
    with contextlib.ExitStack() as stack:
        native = open_model(dataclasses.replace(cfg, chat_template="chatml"), stack)
        assert native is opened[1]
        assert early_open._early is None  # taken once
        with contextlib.ExitStack() as again:
            assert open_model(cfg, again) is not native  # the next one opens its own


@pytest.mark.parametrize(
    "change",
    [{"n_ctx": 1024}, {"n_threads": 2}, {"type_v": "q8_0", "flash_attn": "on"}, {"n_batch": 256}],
    ids=["n_ctx", "threads", "kv-type", "batch"],
)
def test_another_configuration_gets_its_own_context(
    tiny_models: TinyModels, change: dict[str, object]
) -> None:
    cfg = tiny_config(tiny_models.base)
    assert open_early(cfg)
    opened = early_open._early
    assert opened is not None
    other = dataclasses.replace(cfg, **change)  # type: ignore[arg-type]
    with contextlib.ExitStack() as stack:
        native = open_model(other, stack)
        assert native is not opened[1]
        assert early_open._early is None  # the early one was freed, not kept
        assert native.n_ctx == max(other.n_ctx, 256)


@pytest.mark.parametrize("other", ["other_weights", "lora"])
def test_another_model_or_adapter_gets_its_own_context(tiny_models: TinyModels, other: str) -> None:
    cfg = tiny_config(tiny_models.base)
    assert open_early(cfg)
    opened = early_open._early
    assert opened is not None
    if other == "lora":
        asked = dataclasses.replace(cfg, loras=(LoraSpec(tiny_models.lora, 1.0),))
    else:
        asked = tiny_config(tiny_models.other_weights)
    with contextlib.ExitStack() as stack:
        assert open_model(asked, stack) is not opened[1]
        assert early_open._early is None


def test_a_session_on_the_early_context_computes_what_a_fresh_one_does(
    tiny_models: TinyModels,
) -> None:
    cfg = tiny_config(tiny_models.base)
    with ModelSession(cfg) as fresh:
        tokens = fresh.tokenize("The early context holds nothing: these logits are the same.")
        fresh.prefill(tokens)
        want = np.array(fresh.last_logits, copy=True)
    assert open_early(cfg)
    with ModelSession(cfg) as taken:
        assert early_open._early is None
        taken.prefill(tokens)
        got = taken.last_logits
    assert got is not None
    np.testing.assert_array_equal(got, want)


def test_a_model_that_cannot_load_is_left_to_the_command(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF but not really")
    assert not open_early(tiny_config(bad))
    assert early_open._early is None


def test_llama_cpp_info_lines_reach_python_when_logged(
    tiny_models: TinyModels, caplog: pytest.LogCaptureFixture
) -> None:
    assert native._quietlog is not None  # setup.py builds it; `make test` installs that
    with (
        caplog.at_level(logging.DEBUG, logger="localkv.llama"),
        ModelSession(tiny_config(tiny_models.base)),
    ):
        pass
    loud = [r for r in caplog.records if r.name == "localkv.llama" and r.levelno == logging.DEBUG]
    assert len(loud) > 100  # llama.cpp describes the model it loads, line by line


def test_the_filter_passes_warnings_errors_and_their_continuations() -> None:
    quietlog = native._quietlog
    assert quietlog is not None
    seen: list[tuple[int, bytes]] = []

    def collect(level: int, text: bytes, user_data: object) -> None:
        seen.append((level, text))

    collector = native.llama_cpp.llama_log_callback(collect)
    lines = [(2, b"info"), (5, b"info goes on"), (3, b"warn"), (5, b"warn goes on"), (4, b"err")]
    lines += [(1, b"debug"), (0, b"none")]
    try:
        address = quietlog.install(ctypes.cast(collector, ctypes.c_void_p).value, False)
        filtered = native.llama_cpp.llama_log_callback(address)
        for level, text in lines:
            filtered(level, text, None)
        assert seen == [(3, b"warn"), (5, b"warn goes on"), (4, b"err")]
        seen.clear()
        quietlog.set_detail(True)
        for level, text in lines:
            filtered(level, text, None)
        assert seen == lines
    finally:
        quietlog.install(ctypes.cast(native._route_log, ctypes.c_void_p).value, False)
        native.sync_log_detail()


_NAMES = "sorted(n for n in dir(llama_cpp) if not n.startswith('_'))"


def _python(code: str) -> list[str]:
    """Lines a fresh interpreter prints for ``code`` (this process imported everything)."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.splitlines()


def test_the_early_open_waits_for_no_high_level_llama_cpp_or_numpy() -> None:
    code = "import sys, localkv.cli.early, localkv.model.early_open\n"
    code += "print(sorted(m for m in ('llama_cpp.llama', 'jinja2', 'numpy') if m in sys.modules))"
    assert _python(code) == ["[]"]


_OPEN_BEFORE_CLICK = """
import sys
sys.argv = {argv!r}
state = []
def hook(event, args):
    if event == "import" and args[0] == "click" and not state:
        early = sys.modules.get("localkv.cli.early")
        state.append(getattr(early, "_thread", None) is not None)
sys.addaudithook(hook)
import localkv.cli
print("open before click:", state)
localkv.cli.early.wait()
"""


@pytest.mark.parametrize("prog", ["/venv/bin/localkv", "/src/localkv/__main__.py"])
def test_the_command_opens_its_model_before_click_and_the_cli_load(
    tiny_models: TinyModels, prog: str
) -> None:
    argv = [prog, "ask", "--model", str(tiny_models.base), "doc.txt", "q"]
    assert _python(_OPEN_BEFORE_CLICK.format(argv=argv)) == ["open before click: [True]"]
    # another program (or `-v` before the command) loads click first and opens nothing yet
    argv = ["/venv/bin/pytest", *argv[1:]]
    assert _python(_OPEN_BEFORE_CLICK.format(argv=argv)) == ["open before click: [False]"]
    argv = [prog, "-v", *argv[1:]]
    assert _python(_OPEN_BEFORE_CLICK.format(argv=argv)) == ["open before click: [False]"]


def test_the_llama_cpp_package_is_whole_when_its_high_level_names_are_used() -> None:
    plain = _python(f"import json, llama_cpp; print(json.dumps({_NAMES}))")
    code = "import json, sys, localkv.model.native, llama_cpp\n"
    code += f"print(json.dumps({_NAMES})); print(llama_cpp.__version__)\n"
    code += "from llama_cpp import Llama, LlamaGrammar\n"
    code += f"print(json.dumps({_NAMES})); print(Llama is sys.modules['llama_cpp.llama'].Llama)\n"
    code += "print(all(getattr(llama_cpp, n) is getattr(sys.modules['llama_cpp.llama'], n)"
    code += " for n in vars(sys.modules['llama_cpp.llama']) if not n.startswith('_')))"
    before, version, after, same, every = _python(code)
    assert version == native.llama_cpp.__version__
    assert "llama_decode" in json.loads(before) and "Llama" not in json.loads(before)
    assert json.loads(after) == json.loads(plain[0])  # what `import llama_cpp` binds, and no more
    assert same == every == "True"


def _threads_after_numpy(call_main: bool, blas: str | None) -> tuple[str, int]:
    """OPENBLAS_NUM_THREADS and the process's threads once numpy is loaded."""
    import os

    env = {k: v for k, v in os.environ.items() if k != BLAS_THREADS}
    env.update({BLAS_THREADS: blas} if blas is not None else {})
    code = "import os, sys\n"
    if call_main:
        code += "sys.argv = ['localkv', '--version']\nfrom localkv.cli import main\n"
        code += "try:\n    main()\nexcept SystemExit:\n    pass\n"
    code += f"import numpy\nprint(os.environ.get({BLAS_THREADS!r}))\n"
    code += "print(len(os.listdir('/proc/self/task')))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    value, threads = done.stdout.splitlines()[-2:]
    return value, int(threads)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_the_command_line_loads_numpy_with_one_blas_thread_unless_the_user_set_it() -> None:
    import os

    value, ours = _threads_after_numpy(True, None)
    assert value == "1"
    assert ours == _threads_after_numpy(False, "1")[1]
    if len(os.sched_getaffinity(0)) > 1:  # OpenBLAS's own default: a thread for each core
        assert _threads_after_numpy(False, None)[1] > ours
    value, theirs = _threads_after_numpy(True, "2")
    assert value == "2" and theirs == _threads_after_numpy(False, "2")[1]


def test_the_early_open_decodes_the_layout_probe_and_the_identity_is_unchanged(
    tiny_models: TinyModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny_config(tiny_models.base)
    with ModelSession(cfg) as fresh:
        expected = identity_of(fresh, FileHasher())
        token = fresh.bos_token()
        fresh.decode_one(0 if token is None else token)
        fresh_state = fresh.capture_array()
    assert open_early(cfg)
    opened = early_open._early
    assert opened is not None and opened[1].probed is not None
    probed_token, raw = opened[1].probed
    assert probed_token == (0 if token is None else token)
    assert np.array_equal(np.frombuffer(raw, dtype=np.uint8), fresh_state)  # the same bytes
    with ModelSession(cfg) as s:
        assert s.probed is opened[1].probed and s.n_tokens == 0
        assert native.llama_cpp.llama_memory_seq_pos_max(s.memory, 0) == -1  # emptied

        def no_decode(*args: object, **kwargs: object) -> None:
            raise AssertionError("the layout probe decoded again")

        monkeypatch.setattr(s, "decode_one", no_decode)
        captures = STATE_WORK.captures
        assert identity_of(s, FileHasher()) == expected
        assert STATE_WORK.captures == captures + 1  # counted as the capture it stands for
        assert s.probed is None  # taken once
        monkeypatch.undo()
        kv, _ = probe_kv_layout(s)  # a second probe decodes as before
        assert kv is not None and kv.layout() == expected_layout(expected)


def expected_layout(identity: Identity) -> tuple[tuple[int, int, int, int], ...]:
    return tuple(
        (native.ggml_type_id(kt), kb, native.ggml_type_id(vt), vb)
        for kt, kb, vt, vb in identity.kv_layout
    )


@pytest.fixture(scope="module")
def arch_models(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: Path
) -> TinyArchModels:
    return build_tiny_arch_models(tmp_path_factory.mktemp("arch"), default_model_path)


@pytest.mark.parametrize("arch", ["gemma3", "lfm2", "mamba2", "qwen35"])
def test_the_early_open_leaves_other_memory_kinds_to_the_probe(
    arch: str, arch_models: TinyArchModels
) -> None:
    cfg = tiny_config(arch_models.all()[arch])
    with ModelSession(cfg) as fresh:
        expected = identity_of(fresh, FileHasher())
        assert not fresh.in_pieces  # one sequence: only plain KV memory restores in pieces
    assert open_early(cfg)
    opened = early_open._early
    assert opened is not None and opened[1].probed is None  # their probe reads more than this
    with ModelSession(cfg) as s:
        assert identity_of(s, FileHasher()) == expected


_COLLECTOR = """
import gc, sys
sys.argv = {argv!r}
seen = []
gc.callbacks.append(lambda phase, info: phase == "start" and seen.append(1))
import localkv.cli.early as early
held, before = not gc.isenabled(), len(seen)
wait = early.wait
def waited():
    if not getattr(early, "seen_wait", False):
        early.seen_wait = True
        print("at wait:", gc.isenabled(), len(seen) - before)
    wait()
early.wait = waited
from localkv.cli import main
try:
    main()
except SystemExit:
    pass
print("held:", held, "after:", gc.isenabled(), gc.get_freeze_count() > 0)
"""


def _collector(argv: list[str], env: dict[str, str]) -> list[str]:
    code = _COLLECTOR.format(argv=argv)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line.startswith(("at wait", "held"))]


def test_the_collector_is_off_while_ask_loads_and_on_after(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    import os

    env = {**os.environ, "LOCALKV_HOME": str(tmp_path / "home")}
    doc = tmp_path / "doc.txt"
    doc.write_text("The meeting is on Friday.")
    ask_argv = ["ask", "--model", str(tiny_models.base), "--max-tokens", "1", str(doc), "When?"]
    for prog in ("/venv/bin/localkv", "/src/localkv/__main__.py"):
        # no collection from the command line's imports to the model it opened, then on again
        assert _collector([prog, *ask_argv], env) == [
            "at wait: False 0",
            "held: True after: True True",
        ]
    # --help opens nothing: the collector is on again as the command line loads (and frozen)
    assert _collector(["/venv/bin/localkv", "ask", "--help"], env) == [
        "held: False after: True True"
    ]
    assert _collector(["/venv/bin/localkv", "cache", "ls"], env) == [
        "held: False after: True False"
    ]
    # another program that runs the command line is left alone: its collector ran throughout
    at_wait, last = _collector(["/venv/bin/pytest", *ask_argv], env)
    assert last == "held: False after: True False"
    assert at_wait.startswith("at wait: True ") and int(at_wait.split()[-1]) > 0
