"""The one place that loads llama.cpp: backend start-up, log routing, type names.

llama-cpp-python prints llama.cpp's log to stderr by default; localkv routes it
to the ``localkv.llama`` logger instead (DEBUG for info lines, WARNING/ERROR
as llama.cpp rates them), so nothing is printed behind the user's back.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import importlib
import importlib.util
import logging
import os
import sys
import threading
import types
from typing import Any

from localkv.model.threads import runnable_others, wait_settings

# OpenMP's wait is chosen from the machine's load before llama.cpp loads
# (localkv.model.threads). A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
CHOSEN_MARK = "LOCALKV_OPENMP_CHOSEN"  # what localkv itself set, for the processes it starts


def _choose_wait_policy() -> str:
    """Set the OpenMP wait from the machine's load unless the user set it; how it was chosen.

    What localkv sets is marked (``CHOSEN_MARK``), so a process it starts, which
    inherits the environment, chooses again rather than taking it for the user's.
    """
    mine = os.environ.get(CHOSEN_MARK, "")
    if mine and mine == _settings_text():
        for name in WAIT_SETTINGS:
            os.environ.pop(name, None)
    if any(os.environ.get(name) for name in WAIT_SETTINGS):
        return "user"
    others = runnable_others()
    if others is None:  # no /proc here: libgomp's default
        return "default"
    choice, settings = wait_settings(others, len(os.sched_getaffinity(0)))
    os.environ.update(settings)
    os.environ[CHOSEN_MARK] = _settings_text()
    return choice


def _settings_text() -> str:
    return " ".join(f"{name}={os.environ.get(name, '')}" for name in WAIT_SETTINGS)


WAIT_CHOICE = _choose_wait_policy()

# The one llama-cpp-python package ``_bindings_first`` was written against: its version
# (pyproject.toml pins it) and the SHA-256 of its ``llama_cpp/__init__.py``, which is
# ``from .llama_cpp import *``, ``from .llama import *``, ``__version__ = "0.3.36"``.
# tests/unit/test_llama_cpp_pin.py fails when the pin or the installed package moves.
BINDINGS_FIRST_FOR = (
    "0.3.36",
    "b05f3332080ca0313fea46964d9ee8f5183197360cf26247ad8fea9fa6b0e62b",
)


def _bindings_first() -> bool:
    """Import llama-cpp-python's ctypes bindings now and its high-level half when first used.

    The package's ``__init__`` runs ``from .llama_cpp import *`` then ``from .llama
    import *``; the second (the ``Llama`` class, its chat formats, caches and
    tokenizers, with their imports) is nothing localkv calls, and importing it
    would come before every model load (``python -X importtime -c "import
    llama_cpp"`` against ``localkv.model.native`` shows what it costs). Python has
    no supported way to import a submodule without its package's ``__init__``,
    so here, and only for the ``__init__`` in ``BINDINGS_FIRST_FOR`` (its bytes'
    hash), the package object is made from the first line alone, and the second
    runs when a name only it gives is asked for (a module ``__getattr__``, PEP 562):
    ``llama_cpp.Llama`` and ``from llama_cpp import *`` still work. Any other
    ``__init__`` (another version), or a package already imported, is left to
    the import system. Whether the package was made here.
    """
    if "llama_cpp" in sys.modules:
        return False
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        return False
    try:
        with open(spec.origin, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return False
    version, known = BINDINGS_FIRST_FOR
    if digest != known:
        return False
    package = importlib.util.module_from_spec(spec)
    sys.modules["llama_cpp"] = package
    try:
        bindings = importlib.import_module("llama_cpp.llama_cpp")
    except BaseException:
        sys.modules.pop("llama_cpp", None)
        raise
    package.__dict__.update(_star(bindings))
    package.__version__ = version  # type: ignore[attr-defined]

    def rest(name: str) -> Any:
        if not name.startswith("__"):  # a dunder (__all__, __wrapped__...) is no name it gives
            package.__dict__.update(_star(importlib.import_module("llama_cpp.llama")))
            package.__dict__.pop("__getattr__", None)
            if name in package.__dict__:
                return package.__dict__[name]
        raise AttributeError(f"module 'llama_cpp' has no attribute {name!r}")

    package.__getattr__ = rest  # type: ignore[method-assign]
    return True


def _star(module: types.ModuleType) -> dict[str, Any]:
    """What ``from module import *`` binds."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [name for name in vars(module) if not name.startswith("_")]
    return {name: getattr(module, name) for name in names}


BINDINGS_FIRST = _bindings_first()

import llama_cpp  # noqa: E402  (after the wait policy: libgomp reads it when it loads)

try:
    from localkv.model import _quietlog
except ImportError:  # not built (setup.py: it is optional): every line goes to Python
    _quietlog = None  # type: ignore[assignment]

__all__ = [
    "BINDINGS_FIRST",
    "BINDINGS_FIRST_FOR",
    "GGML_TYPES",
    "WAIT_CHOICE",
    "WAIT_SETTINGS",
    "ggml_type_id",
    "ggml_type_name",
    "llama_cpp",
    "llama_cpp_version",
    "openmp_settings",
    "recent_errors",
    "sync_log_detail",
    "system_info",
]

log = logging.getLogger("localkv.llama")

# ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the last)
_LEVELS = {
    0: logging.DEBUG,
    1: logging.DEBUG,
    2: logging.DEBUG,  # llama.cpp's "info" is chatty: keep it at debug
    3: logging.WARNING,
    4: logging.ERROR,
}

# KV cache types a user may ask for, by llama.cpp's ggml type ids.
GGML_TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "bf16": 30,
}
_TYPE_NAMES = {v: k for k, v in GGML_TYPES.items()}

_state_lock = threading.Lock()
_started = False
_log_callback: Any = None  # what llama_log_set was given, kept alive
_last_level = logging.DEBUG
_errors: collections.deque[str] = collections.deque(maxlen=8)


@llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
def _route_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    global _last_level
    py_level = _last_level if level == 5 else _LEVELS.get(level, logging.DEBUG)
    _last_level = py_level
    line = text.decode("utf-8", errors="replace").rstrip("\n")
    if py_level >= logging.ERROR and line:
        _errors.append(line)
    if log.isEnabledFor(py_level):
        log.log(py_level, "%s", line)


def recent_errors() -> list[str]:
    """llama.cpp's last error lines, oldest first, and forget them.

    The command line shows llama.cpp's own log only with ``-vv``; a failure
    message quotes the first of these instead, in its own words.
    """
    with _state_lock:
        lines = list(_errors)
        _errors.clear()
    return lines


def ensure_backend() -> None:
    """Start llama.cpp's backend once per process and route its log.

    Through ``_quietlog`` where it was built: llama.cpp's debug and info lines
    reach Python only while ``localkv.llama`` logs at DEBUG (``sync_log_detail``),
    so a model loading in a thread does not wait for the GIL at each of its
    many lines. Without it, every line goes to ``_route_log``.
    """
    global _started, _log_callback
    with _state_lock:
        if _started:
            return
        _log_callback = _route_log
        if _quietlog is not None:
            forward = ctypes.cast(_route_log, ctypes.c_void_p).value or 0
            address = _quietlog.install(forward, log.isEnabledFor(logging.DEBUG))
            _log_callback = llama_cpp.llama_log_callback(address)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _started = True


def sync_log_detail() -> None:
    """Pass llama.cpp's debug and info lines to Python while ``localkv.llama`` logs them."""
    if _quietlog is not None:
        _quietlog.set_detail(log.isEnabledFor(logging.DEBUG))


def ggml_type_id(name: str) -> int:
    """The ggml type id of a KV cache type name such as ``"q8_0"``."""
    try:
        return GGML_TYPES[name.lower()]
    except KeyError:
        known = ", ".join(sorted(GGML_TYPES))
        raise ValueError(f"unknown KV cache type {name!r} (known: {known})") from None


def ggml_type_name(type_id: int) -> str:
    """The name of a ggml type id, or ``"type<N>"`` for one localkv does not name."""
    return _TYPE_NAMES.get(type_id, f"type{type_id}")


def openmp_settings() -> dict[str, str | None]:
    """The OpenMP wait settings llama.cpp runs with, and why (``WAIT_CHOICE``)."""
    found: dict[str, str | None] = {name: os.environ.get(name) for name in WAIT_SETTINGS}
    return {**found, "chosen": WAIT_CHOICE}


def llama_cpp_version() -> str:
    return str(getattr(llama_cpp, "__version__", "unknown"))


def system_info() -> str:
    """llama.cpp's description of the compute backend (CPU features, GPU backends)."""
    ensure_backend()
    raw: Any = llama_cpp.llama_print_system_info()
    return raw.decode("utf-8", errors="replace").strip() if isinstance(raw, bytes) else str(raw)
