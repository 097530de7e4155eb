"""Who may call the server: the checks a request passes before its body is read.

Loopback is not a trust boundary. Every web page the user opens can send
requests to ``127.0.0.1``, and after a DNS rebinding (a name of the page's
site made to resolve to ``127.0.0.1``) the page is same-origin with the
server and may read its answers. So, before any route runs:

- **Host**: a request must name the server by a loopback name (``localhost``,
  a ``*.localhost`` name), an IP address, or a name the user allowed
  (``--allow-host``). An IP address cannot be rebound: a page whose origin
  is an address reached this server only if it was served from it, and the
  server serves no pages. A rebinding page sends its own DNS name and is
  refused (403). With an API key the key is the boundary and any name is
  accepted: a page cannot send a key it does not know.
- **Origin**: a browser names the page that sent a request in ``Origin``
  (every cross-origin request, and every POST) and ``Sec-Fetch-Site``. A
  request from a page whose origin the user has not allowed
  (``--allow-origin``; none by default) is refused (403), whatever its method.
  A request the user typed into the address bar (``Sec-Fetch-Site: none``)
  and clients that are not browsers send neither and pass.
- **Content-Type**: a POST that declares a type must declare JSON. A page may
  send a ``text/plain``, form or multipart POST to any address without asking
  first (no CORS preflight); a JSON POST from another origin needs the
  preflight, which only an allowed origin passes. This holds even for a browser
  that sends no ``Origin``. A POST with no ``Content-Type`` at all passes (some
  clients send none: litellm's Ollama route); its body must still be JSON. A
  page can send one only through ``fetch`` or XHR (a form always has a type),
  and those name their origin, so the Origin check above refused it already.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from localkv.server.errors import ApiError

__all__ = ["Boundary", "normal_origin"]

# the Sec-Fetch-Site values of requests a page on another site did not make
_OWN_FETCH_SITES = ("same-origin", "none")


def normal_origin(origin: str) -> str:
    """``origin`` as browsers send it: ``scheme://host[:port]``, lower case, no slash."""
    text = origin.strip().rstrip("/").lower()
    if text == "*":
        return text
    scheme, sep, rest = text.partition("://")
    if not sep or not scheme or not rest or "/" in rest:
        raise ValueError(f"an origin is scheme://host[:port], not {origin!r}")
    return text


def host_name(host_header: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:80`` -> ``::1``)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Boundary:
    """The names and origins the user allowed; ``keyed``: an API key guards the server."""

    hosts: tuple[str, ...] = ()
    origins: tuple[str, ...] = ()
    keyed: bool = False

    @classmethod
    def of(cls, *, hosts: Iterable[str], origins: Iterable[str], keyed: bool) -> Boundary:
        return cls(
            hosts=tuple(host_name(h) for h in hosts if h.strip()),
            origins=tuple(normal_origin(o) for o in origins if o.strip()),
            keyed=keyed,
        )

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin.strip().rstrip("/").lower() in self.origins

    def check(self, method: str, headers: Mapping[bytes, bytes]) -> None:
        """Refuse (``ApiError``) a request this server's user did not make."""
        self._check_host(headers.get(b"host"))
        self._check_origin(headers)
        if method == "POST":
            _check_json(headers.get(b"content-type"))

    def _check_host(self, raw: bytes | None) -> None:
        if raw is None or self.keyed:
            return  # HTTP/1.0 sends none; a browser always does
        name = host_name(raw.decode("latin-1"))
        if name == "localhost" or name.endswith(".localhost") or _is_ip(name):
            return
        if name in self.hosts:
            return
        raise ApiError(
            403,
            f"the Host {name!r} is not a name of this server: a web page may have made this "
            "request (DNS rebinding); start the server with --allow-host NAME to accept it",
            code="host_not_allowed",
        )

    def _check_origin(self, headers: Mapping[bytes, bytes]) -> None:
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1")
            if self.origin_allowed(text):
                return
            raise ApiError(
                403,
                f"requests from web pages at {text} are not allowed; start the server with "
                f"--allow-origin {text} (or LOCALKV_ORIGINS) to let that page use it",
                code="origin_not_allowed",
            )
        site = headers.get(b"sec-fetch-site", b"none").decode("latin-1").lower()
        if site not in _OWN_FETCH_SITES:
            raise ApiError(
                403,
                f"a request from a web page of another site (Sec-Fetch-Site: {site}) "
                "without an allowed Origin",
                code="origin_not_allowed",
            )


def _check_json(raw: bytes | None) -> None:
    if raw is None:
        return  # no type declared: not a form, and not from a page that passed the Origin check
    media = raw.decode("latin-1").partition(";")[0].strip().lower()
    if media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    ):
        return
    shown = media or "none"
    raise ApiError(
        415,
        f"the body must be JSON: send 'Content-Type: application/json' (got {shown})",
        code="unsupported_media_type",
    )
