"""``localkv serve``: the OpenAI-compatible HTTP server (needs the ``serve`` extra)."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import click
import uvicorn

from localkv.cli.options import cache_options, model_options, open_runtime, session_config
from localkv.model.native import openmp_settings
from localkv.prompt.templatechoice import ChatTemplateError
from localkv.server.app import ServerSettings, create_app
from localkv.server.boundary import normal_origin
from localkv.server.engine import Engine
from localkv.server.http import server_config
from localkv.server.worker import QUEUE_WAIT_S, STOP_GRACE_S, ModelWorker

__all__ = ["MAX_TOKENS", "QUEUE", "serve"]

QUEUE = 16  # room for the requests an agent sends together
MAX_TOKENS = 4096  # an answer's limit when its request gives none, and the most it may ask

_EPILOG = """Only you may use it: a web page you open can send requests to 127.0.0.1, so a
request that names another host (DNS rebinding), comes from a page whose origin
is not allowed (--allow-origin), or POSTs anything but JSON is refused with 403
or 415 before it is read.

\b
Endpoints: GET /health (503 while the model loads), GET /v1/localkv/cache,
POST /v1/localkv/prefill; every generation streaming and not:
  OpenAI:     GET /v1/models, POST /v1/chat/completions, POST /v1/completions
  Responses:  POST /v1/responses
  Anthropic:  POST /v1/messages, POST /v1/messages/count_tokens
  Ollama:     GET /api/version, /api/tags, /api/ps; POST /api/show, /api/chat,
              /api/generate
Example:
  localkv serve --port 8000
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "local", "messages": [{"role": "user", "content": "Hello"}]}'
"""


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM/SIGINT end it with exit status 0.

    uvicorn shuts down gracefully on them and then raises the signal again
    (dying by it); a finished graceful shutdown is a clean exit here. The
    shutdown first cancels the admitted requests, so that it does not wait for
    their answers, and lasts at most the worker's grace period; a model thread
    still busy then is not waited for (exit status 1).
    """

    def __init__(self, config: uvicorn.Config, worker: ModelWorker) -> None:
        super().__init__(config)
        self.worker = worker

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.worker.cancel_all()  # the running request stops at its next token
        await super().shutdown(sockets)

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        super().run(sockets)
        if self.started and self.worker.alive():  # in a native call past the grace period
            grace = self.worker.grace_s
            click.echo(f"localkv serve: the model did not stop within {grace:g} s", err=True)
            logging.shutdown()
            os._exit(1)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        wanted = [signal.SIGINT, signal.SIGTERM]
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in wanted}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _settings(
    *,
    host: str,
    api_key: str | None,
    allow_origins: tuple[str, ...],
    allow_hosts: tuple[str, ...],
    queue: int,
    max_body: int,
) -> ServerSettings:
    """The server's settings from its options, or the usage error that refuses them."""
    if not _is_loopback(host) and not api_key:
        raise click.UsageError(
            f"--host {host} is reachable from other machines: give --api-key KEY "
            "(or LOCALKV_API_KEY) to bind it"
        )
    if api_key is not None and not api_key.strip():
        raise click.BadParameter("the API key is empty", param_hint="--api-key")
    origins, hosts = _listed(allow_origins), _listed(allow_hosts)
    for origin in origins:
        try:
            normal_origin(origin)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--allow-origin") from None
    return ServerSettings(
        api_key=api_key,
        queue=queue,
        max_body=max_body,
        allowed_hosts=(host, *hosts),
        allowed_origins=origins,
    )


def _listed(values: tuple[str, ...]) -> tuple[str, ...]:
    """Repeated values, each of which may hold several separated by commas or spaces."""
    return tuple(part for value in values for part in value.replace(",", " ").split())


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@click.command(epilog=_EPILOG)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port."
)
@click.option(
    "--api-key",
    envvar="LOCALKV_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' on /v1 (needed to bind a non-loopback "
    "address). [env: LOCALKV_API_KEY]",
)
@click.option(
    "--allow-origin",
    "allow_origins",
    multiple=True,
    envvar="LOCALKV_ORIGINS",
    metavar="ORIGIN",
    help="A web page origin (scheme://host:port, as the browser shows it) that may call the "
    "server, e.g. a web UI's http://localhost:3000; repeat it or separate with commas; '*' "
    "allows every page. Requests from other pages get 403. [env: LOCALKV_ORIGINS]",
)
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    envvar="LOCALKV_ALLOWED_HOSTS",
    metavar="NAME",
    help="A host name besides localhost and IP addresses that clients may call the server by "
    "(e.g. a name in /etc/hosts); repeat it or separate with commas. Other names get 403: a "
    "page that made its own name point here (DNS rebinding) sends it. [env: LOCALKV_ALLOWED_HOSTS]",
)
@click.option(
    "--queue",
    type=click.IntRange(min=1),
    default=QUEUE,
    show_default=True,
    help="Requests admitted at once, the running one included: those sent together (an "
    "agent's subagents, its title request) wait their turn, in order; more get 503 with "
    "Retry-After at once.",
)
@click.option(
    "--queue-wait",
    type=click.FloatRange(min=0),
    default=QUEUE_WAIT_S,
    show_default=True,
    metavar="SECONDS",
    help="The longest a request waits for its turn; then it gets 503 with Retry-After. "
    "0: as long as it takes. A waiting request whose client leaves is dropped at once.",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=0),
    envvar="LOCALKV_MAX_TOKENS",
    default=MAX_TOKENS,
    show_default=True,
    help="The most tokens an answer may have: the limit of a request that gives none "
    "(Codex, aider), and a larger limit asked for is capped to it, so a runaway answer "
    "never holds the queue longer. The answer then ends with finish reason 'length'. "
    "0: no limit but the context. [env: LOCALKV_MAX_TOKENS]",
)
@click.option(
    "--max-body",
    type=click.IntRange(min=1024),
    default=16 * 2**20,
    show_default=True,
    help="Largest request body in bytes; larger ones get 413.",
)
@click.option(
    "--stop-grace",
    type=click.FloatRange(min=0),
    default=STOP_GRACE_S,
    show_default=True,
    help="Seconds SIGTERM or Ctrl-C waits for the running request to stop and the saves "
    "to complete; then the server exits anyway.",
)
@click.option(
    "--keep-client-headers",
    is_flag=True,
    envvar="LOCALKV_KEEP_CLIENT_HEADERS",
    help="Keep the per-session text clients put before their prompts (Claude Code's "
    "x-anthropic-billing-header block) in the tokens; by default it is left out, so a new "
    "session reuses the cached system prompt. System messages are placed the same either "
    "way. [env: LOCALKV_KEEP_CLIENT_HEADERS]",
)
@model_options
@cache_options
def serve(  # noqa: PLR0913, PLR0917 - click passes each option by parameter
    host: str,
    port: int,
    api_key: str | None,
    allow_origins: tuple[str, ...],
    allow_hosts: tuple[str, ...],
    queue: int,
    queue_wait: float,
    max_tokens: int,
    max_body: int,
    stop_grace: float,
    keep_client_headers: bool,
    **opts: Any,
) -> None:
    """Serve the model over the OpenAI, Responses, Anthropic and Ollama HTTP APIs, cached.

    Chat UIs and SDKs (openai, LangChain, Open WebUI, ...) point their base URL
    at http://HOST:PORT/v1. A system prompt or document computed once is
    restored from disk on later requests, across restarts; every response
    reports usage.prompt_tokens_details.cached_tokens and a `localkv` object
    (verified, restore_ms, miss_reason). Each saved prefix is a snapshot
    labelled `server: <first words>`: `localkv cache ls` and GET
    /v1/localkv/cache list it, `cache pin`/`rm` pin and remove it; a client's pins
    (`pin`, `cache_control`) hold at most LOCALKV_CLIENT_PINS (0.25) of the cache
    budget, never the user's cache. One line per request is logged to stderr.

    SIGTERM
    or Ctrl-C stops the running and waiting requests at their next token, lets
    the background saves complete and exits 0; past --stop-grace it exits 1.
    """
    settings = _settings(
        host=host,
        api_key=api_key,
        allow_origins=allow_origins,
        allow_hosts=allow_hosts,
        queue=queue,
        max_body=max_body,
    )
    settings = replace(settings, keep_client_headers=keep_client_headers)
    failed: list[BaseException] = []
    server: list[uvicorn.Server] = []

    def on_failure(exc: BaseException) -> None:
        failed.append(exc)
        if server:
            server[0].should_exit = True

    limits = _Limits(
        queue=queue, queue_wait=queue_wait, max_tokens=max_tokens, stop_grace=stop_grace
    )
    worker = _worker(opts, limits, on_failure)
    config = session_config(opts)  # a missing model fails here, before binding
    if logging.getLogger().getEffectiveLevel() > logging.INFO:  # -v, -vv show more
        logging.getLogger("localkv.server").setLevel(logging.INFO)
    app = create_app(settings, worker)
    uv = _Server(server_config(app, host=host, port=port, grace_s=stop_grace), worker)
    server.append(uv)
    click.echo(f"localkv serve: http://{host}:{port}/v1 (model {config.model_path})", err=True)
    uv.run()
    _exit(failed, started=uv.started)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Limits:
    """What the queue admits, how long a request waits and an answer runs (0: no limit)."""

    queue: int
    queue_wait: float
    max_tokens: int
    stop_grace: float


def _worker(
    opts: dict[str, Any], limits: _Limits, on_failure: Callable[[BaseException], None]
) -> ModelWorker:
    """The model's worker: it opens the engine the options describe on its own thread."""
    if not math.isfinite(limits.queue_wait):
        raise click.BadParameter(
            "give a finite number of seconds (0: no limit)", param_hint="--queue-wait"
        )
    max_tokens = limits.max_tokens or None

    def open_engine() -> Engine:
        runtime = open_runtime(opts)
        # on the model thread, which restores: the first request after a start then
        # faults in no page of the restore's buffers
        ready = runtime.prepare_restores()
        logger = logging.getLogger("localkv.server")
        if ready:
            logger.info("restore buffers ready: %.1f MiB", ready / (1 << 20))
        wait = openmp_settings()
        logger.info(
            "llama.cpp threads: %d; OpenMP wait: %s (%s)",
            runtime.session.threads.current,
            wait.pop("chosen"),
            ", ".join(f"{k}={v}" for k, v in wait.items() if v is not None) or "libgomp's default",
        )
        return Engine(runtime, max_tokens=max_tokens)

    wait_s = limits.queue_wait or None
    return ModelWorker(open_engine, limits.queue, on_failure, limits.stop_grace, wait_s)


class _LoadError(click.ClickException):
    """The model could not be loaded."""


class _TemplateRefused(_LoadError):
    """The model's chat template was refused: a usage error, as in ``ask`` and ``chat``."""

    exit_code = 2


def _exit(failed: list[BaseException], *, started: bool) -> None:
    """After the server stopped: an error if the model failed or the server never started."""
    if failed:
        kind = _TemplateRefused if isinstance(failed[0], ChatTemplateError) else _LoadError
        raise kind(f"the model could not be loaded: {failed[0]}")
    if not started:
        sys.exit(1)  # uvicorn said why (the port is taken, ...)
