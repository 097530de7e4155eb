"""A real headless Chromium on pages of made-up sites, for what a web page can do to the server.

``Sites`` is an HTTP proxy that Chromium is told to use for every name but
loopback ones. It answers a page's own address with that page, collects what
the page reports at ``/__result``, and forwards everything else to the same
port on 127.0.0.1 with the page's ``Host`` unchanged: what the server sees
from a page whose name was made to resolve to 127.0.0.1 (DNS rebinding). A
page may also call ``http://127.0.0.1:PORT`` itself (a cross-origin request
from another site): Chromium sends that directly, not through the proxy.
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = ["Sites", "chromium", "open_page"]

RESULT_PATH = "/__result"
# Chromium's own checks of pages calling loopback (Local/Private Network Access)
# are switched off, so that each request reaches the server and what is tested is
# the server's own refusal, as it is for a browser without those checks.
_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-features=LocalNetworkAccessChecks,BlockInsecurePrivateNetworkRequests,"
    "PrivateNetworkAccessSendPreflights,PrivateNetworkAccessRespectPreflightResults,"
    "HttpsUpgrades,HttpsFirstBalancedModeAutoEnable",
)


def chromium() -> str:
    """Debian's Chromium (``make test`` installs it)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError("no chromium on PATH: `make test` installs Debian's chromium package")
    return path


class Sites:
    """The proxy: ``pages`` maps ``host:port`` to the HTML served at its ``/``."""

    def __init__(self) -> None:
        self.pages: dict[str, str] = {}
        self.results: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        sites = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                sites._handle(self)

            def do_POST(self) -> None:
                sites._handle(self)

            def do_OPTIONS(self) -> None:
                sites._handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Sites:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait_result(self, timeout_s: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self.results:
                    return self.results.pop(0)
            time.sleep(0.1)
        raise TimeoutError("the page reported nothing")

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        url = urlsplit(h.path)
        size = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(size) if size else b""
        if url.path == RESULT_PATH and h.command == "POST":
            with self._lock:
                self.results.append(json.loads(body))
            self._answer(h, 204, {}, b"")
            return
        if url.path == "/favicon.ico":  # asked for by the browser, not by the page
            self._answer(h, 404, {}, b"")
            return
        page = self.pages.get(url.netloc)
        if page is not None and url.path == "/" and h.command == "GET":
            self._answer(h, 200, {"Content-Type": "text/html"}, page.encode())
            return
        self._forward(h, url.port or 80, url.path + (f"?{url.query}" if url.query else ""), body)

    def _forward(self, h: BaseHTTPRequestHandler, port: int, path: str, body: bytes) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        headers = {k: v for k, v in h.headers.items() if k.lower() != "proxy-connection"}
        try:
            conn.request(h.command, path, body=body or None, headers=headers)
            r = conn.getresponse()
            data = r.read()
            kept = {k: v for k, v in r.getheaders() if k.lower() not in _HOP}
            self._answer(h, r.status, kept, data)
        except OSError as exc:
            self._answer(h, 502, {"Content-Type": "text/plain"}, str(exc).encode())
        finally:
            conn.close()

    @staticmethod
    def _answer(
        h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes
    ) -> None:
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(body)


_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


@contextmanager
def open_page(sites: Sites, url: str, profile: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Chromium showing ``url`` through ``sites``, until the block ends."""
    cmd = [
        chromium(),
        *_FLAGS,
        f"--user-data-dir={profile}",
        f"--proxy-server=http://127.0.0.1:{sites.port}",
        "--remote-debugging-port=0",
        url,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
