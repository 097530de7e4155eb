"""Only the server's user may use it: web pages, rebound names and non-JSON posts are refused.

A real ``localkv serve`` on the tiny model, called with hand-made headers and
from pages in a real headless Chromium (``support.browser``): a page whose
name was rebound to 127.0.0.1, a page of another site calling 127.0.0.1, and
a page whose origin the user allowed. Each refused request must change
nothing: the cache is read afterwards through an ordinary client.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.browser import Sites, open_page
from support.processes import run_localkv
from support.server import ServerProcess
from support.tinymodels import TinyModels

SECRET = "My bank PIN is 4721 and the safe code is 9090"
PLANTED = "planted by a web page"
WEBUI = "http://webui.example:8124"


def serve(tmp_path: Path, tiny_models: TinyModels, name: str, *extra: str) -> ServerProcess:
    args = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "1024", *extra]
    return ServerProcess(args, tmp_path / f"{name}.log")


@pytest.fixture()
def server(tmp_path: Path, tiny_models: TinyModels) -> Iterator[ServerProcess]:
    with serve(tmp_path, tiny_models, "server") as proc:
        # the user's own conversation, which pages must not read
        r = own_post(proc, "/v1/chat/completions", chat(SECRET))
        assert r.status_code == 200, r.text
        wait_listed(proc, "server: My bank PIN")
        yield proc
        assert "Traceback" not in proc.log()


def chat(text: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "temperature": 0,
    }


def own_post(proc: ServerProcess, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(
        proc.base_url + path,
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
        timeout=300,
    )


def snapshots(proc: ServerProcess) -> list[dict[str, Any]]:
    r = httpx.get(proc.base_url + "/v1/localkv/cache", timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["data"]  # type: ignore[no-any-return]


def wait_listed(proc: ServerProcess, label: str) -> None:
    """Saves run in the background: wait until ``label`` is listed."""
    for _ in range(600):
        if any(str(s.get("label", "")).startswith(label) for s in snapshots(proc)):
            return
        time.sleep(0.1)
    raise AssertionError(f"{label!r} was never listed: {snapshots(proc)}")


def nothing_planted(proc: ServerProcess) -> None:
    rows = snapshots(proc)
    assert [s["label"] for s in rows if PLANTED in str(s["label"])] == [], rows
    assert [s for s in rows if s.get("pinned")] == [], rows


def refusals(proc: ServerProcess) -> int:
    return proc.log().count("refused ")


# ------------------------------------------------------------- hand-made headers
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/localkv/cache", None),
        ("GET", "/health", None),
        ("POST", "/api/show", {"model": "tiny"}),
        ("POST", "/v1/chat/completions", chat(SECRET)),
    ],
)
def test_a_request_naming_another_host_gets_403_and_reads_nothing(
    server: ServerProcess, method: str, path: str, body: Any
) -> None:
    content = json.dumps(body).encode() if body is not None else None
    headers = {"Host": f"evil.example:{server.port}", "Content-Type": "application/json"}
    r = httpx.request(method, server.base_url + path, content=content, headers=headers)
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    text = error if isinstance(error, str) else error["message"]
    assert "evil.example" in text and "--allow-host" in text
    assert "4721" not in r.text and "My bank" not in r.text and str(Path.home()) not in r.text


def test_loopback_names_and_addresses_are_the_servers_own(server: ServerProcess) -> None:
    for host in ("localhost", "127.0.0.1", "[::1]", "app.localhost", "LOCALHOST."):
        r = httpx.get(
            server.base_url + "/v1/models", headers={"Host": f"{host}:{server.port}"}, timeout=60
        )
        assert r.status_code == 200, (host, r.text)


def test_an_allowed_host_name_works(tmp_path: Path, tiny_models: TinyModels) -> None:
    with serve(tmp_path, tiny_models, "hosts", "--allow-host", "mybox.lan") as proc:
        ok = httpx.get(proc.base_url + "/v1/models", headers={"Host": "mybox.lan:80"})
        other = httpx.get(proc.base_url + "/v1/models", headers={"Host": "evil.example"})
    assert ok.status_code == 200 and other.status_code == 403


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""],
)
def test_a_post_that_is_not_json_changes_nothing(
    server: ServerProcess, content_type: str | None
) -> None:
    body = json.dumps({"system": PLANTED, "pin": True}).encode()
    headers = {"Content-Type": content_type}
    r = httpx.post(server.base_url + "/v1/localkv/prefill", content=body, headers=headers)
    assert r.status_code == 415, r.text
    assert "Content-Type: application/json" in r.json()["error"]["message"]
    nothing_planted(server)


def test_a_post_with_no_content_type_is_read_as_json(server: ServerProcess) -> None:
    """litellm (aider's Ollama route) posts its JSON with no Content-Type at all."""
    body = json.dumps({"model": "tiny", "stream": False, "options": {"num_predict": 1},
                       "messages": [{"role": "user", "content": "Hello"}]})  # fmt: skip
    r = httpx.post(server.base_url + "/api/chat", content=body.encode())
    assert r.request.headers.get("content-type") is None
    assert r.status_code == 200 and r.json()["done"] is True, r.text
    not_json = httpx.post(server.base_url + "/api/chat", content=b"system=x")
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]


def test_a_post_from_a_page_of_another_origin_changes_nothing(server: ServerProcess) -> None:
    before = refusals(server)
    r = own_post(
        server,
        "/v1/localkv/prefill",
        {"system": PLANTED, "pin": True},
        Origin="http://evil.example",
    )
    assert r.status_code == 403 and "--allow-origin" in r.json()["error"]["message"], r.text
    cross_site = httpx.get(
        server.base_url + "/v1/localkv/cache", headers={"Sec-Fetch-Site": "cross-site"}
    )
    assert cross_site.status_code == 403 and "4721" not in cross_site.text
    assert refusals(server) == before + 2
    nothing_planted(server)


# ------------------------------------------------------------------- a browser
REBINDING_PAGE = """<!doctype html><script>
async function attempt(out, name, path, init) {
  try { const r = await fetch(path, init); out[name] = {status: r.status, body: await r.text()}; }
  catch (e) { out[name] = {error: String(e)}; }
}
(async () => {
  const out = {}, json = {'Content-Type': 'application/json'};
  await attempt(out, 'cache', '/v1/localkv/cache');
  await attempt(out, 'show', '/api/show',
    {method: 'POST', headers: json, body: JSON.stringify({model: 'tiny'})});
  await attempt(out, 'chat', '/v1/chat/completions', {method: 'POST', headers: json,
    body: JSON.stringify({model: 'tiny', max_tokens: 1,
                          messages: [{role: 'user', content: 'My bank PIN is 4721'}]})});
  await attempt(out, 'prefill', '/v1/localkv/prefill', {method: 'POST', headers: json,
    body: JSON.stringify({system: 'PLANTED', pin: true})});
  await fetch('/__result', {method: 'POST', body: JSON.stringify(out)});
})();
</script>"""

CROSS_ORIGIN_PAGE = """<!doctype html><script>
async function attempt(out, name, url, init) {
  try { const r = await fetch(url, init); out[name] = {status: r.status, type: r.type}; }
  catch (e) { out[name] = {error: String(e)}; }
}
(async () => {
  const out = {}, base = 'BASE', planted = JSON.stringify({system: 'PLANTED', pin: true});
  const kept = JSON.stringify({model: 'tiny', max_tokens: 1,
    system: [{type: 'text', text: 'PLANTED too', cache_control: {type: 'ephemeral', ttl: '1h'}}],
    messages: [{role: 'user', content: 'hi'}]});
  await attempt(out, 'cache', base + '/v1/localkv/cache');
  await attempt(out, 'cache-no-cors', base + '/v1/localkv/cache', {mode: 'no-cors'});
  for (const type of ['text/plain', 'application/x-www-form-urlencoded']) {
    await attempt(out, 'prefill ' + type, base + '/v1/localkv/prefill',
      {method: 'POST', mode: 'no-cors', headers: {'Content-Type': type}, body: planted});
    await attempt(out, 'messages ' + type, base + '/v1/messages',
      {method: 'POST', mode: 'no-cors', headers: {'Content-Type': type}, body: kept});
  }
  await attempt(out, 'prefill untyped', base + '/v1/localkv/prefill',
    {method: 'POST', mode: 'no-cors', body: new Blob([planted])});
  await attempt(out, 'prefill json', base + '/v1/localkv/prefill',
    {method: 'POST', headers: {'Content-Type': 'application/json'}, body: planted});
  await fetch('/__result', {method: 'POST', body: JSON.stringify(out)});
})();
</script>"""

ALLOWED_PAGE = """<!doctype html><script>
(async () => {
  const out = {}, base = 'BASE';
  try {
    const models = await fetch(base + '/v1/models');
    out.models = {status: models.status, body: await models.json()};
    const chat = await fetch(base + '/v1/chat/completions', {method: 'POST',
      headers: {'Content-Type': 'application/json'},
      body: JSON.stringify({model: 'tiny', max_tokens: 2, temperature: 0,
                            messages: [{role: 'user', content: 'Hello'}]})});
    out.chat = {status: chat.status, body: await chat.json()};
  } catch (e) { out.error = String(e); }
  await fetch('/__result', {method: 'POST', body: JSON.stringify(out)});
})();
</script>"""


def test_a_rebound_page_reads_and_writes_nothing(server: ServerProcess, tmp_path: Path) -> None:
    with Sites() as sites:
        origin = f"rebound.example:{server.port}"  # the server's port, under the page's name
        sites.pages[origin] = REBINDING_PAGE.replace("PLANTED", PLANTED)
        before = refusals(server)
        with open_page(sites, f"http://{origin}/", tmp_path / "profile"):
            out = sites.wait_result()
    assert {name: seen.get("status") for name, seen in out.items()} == {
        "cache": 403,
        "show": 403,
        "chat": 403,
        "prefill": 403,
    }, out
    assert "4721" not in json.dumps(out) and str(Path.home()) not in json.dumps(out)
    assert refusals(server) == before + 4  # each reached the server and was refused there
    nothing_planted(server)


def test_a_page_of_another_site_reads_and_writes_nothing(
    server: ServerProcess, tmp_path: Path
) -> None:
    with Sites() as sites:
        origin = "attacker.example:8123"
        page = CROSS_ORIGIN_PAGE.replace("BASE", server.base_url).replace("PLANTED", PLANTED)
        sites.pages[origin] = page
        before = refusals(server)
        with open_page(sites, f"http://{origin}/", tmp_path / "profile"):
            out = sites.wait_result()
    # a CORS read fails in the page; no-cors answers are opaque to it
    assert "error" in out["cache"] and "error" in out["prefill json"], out
    # every request reached the server (the JSON POST as its preflight) and was refused
    assert refusals(server) - before == 8, server.log()[-3000:]
    nothing_planted(server)


def test_a_page_whose_origin_is_allowed_works(tmp_path: Path, tiny_models: TinyModels) -> None:
    with (
        serve(tmp_path, tiny_models, "allowed", "--allow-origin", WEBUI) as proc,
        Sites() as sites,
    ):
        sites.pages[WEBUI.removeprefix("http://")] = ALLOWED_PAGE.replace("BASE", proc.base_url)
        with open_page(sites, WEBUI + "/", tmp_path / "profile"):
            out = sites.wait_result()
        refused_other = own_post(
            proc, "/v1/chat/completions", chat("hi"), Origin="http://x.example"
        )
    assert "error" not in out, out
    assert out["models"]["status"] == 200 and out["models"]["body"]["data"], out
    assert out["chat"]["status"] == 200 and out["chat"]["body"]["choices"], out
    assert refused_other.status_code == 403


def test_with_a_key_the_key_is_the_boundary(tmp_path: Path, tiny_models: TinyModels) -> None:
    with serve(tmp_path, tiny_models, "keyed", "--api-key", "sesame") as proc:
        url, host = proc.base_url + "/v1/models", {"Host": "mybox.lan"}
        keyed = httpx.get(url, headers={**host, "Authorization": "Bearer sesame"})
        unkeyed = httpx.get(url, headers=host)
        page = httpx.get(
            url, headers={"Authorization": "Bearer sesame", "Origin": "http://x.example"}
        )
    assert keyed.status_code == 200, keyed.text
    assert unkeyed.status_code == 401, unkeyed.text
    assert page.status_code == 403, page.text  # a page still needs its origin allowed


@pytest.mark.parametrize("origin", ["localhost:3000", "http://", "http://a.example/path"])
def test_a_malformed_allowed_origin_is_a_usage_error(tiny_models: TinyModels, origin: str) -> None:
    args = ["serve", "--model", str(tiny_models.base), "--allow-origin", origin]
    done = run_localkv(dict(os.environ), *args, timeout_s=120)
    assert done.returncode == 2, done.stderr
    assert "--allow-origin" in done.stderr and "scheme://host" in done.stderr
    assert "Traceback" not in done.stderr
