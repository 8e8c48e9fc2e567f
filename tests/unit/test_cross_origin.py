"""Which hosts and web origins may reach the server: DNS rebinding, CORS, and a
page of another origin posting without a preflight."""

from __future__ import annotations

import json

import httpx
import pytest

from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import serve_app
from tests.unit.test_http_api import make_app
from tests.unit.test_reliability import (
    CHAT,
    MESSAGES,
    anthropic,
    chat,
)


@pytest.fixture(scope="module")
def base():
    with serve_app(make_app()) as url:
        yield url


def test_dns_rebinding_hosts_are_refused_on_loopback(base):
    refused = httpx.get(base + "/v1/models", headers={"Host": "evil.example"})
    assert refused.status_code == 400  # in the JSON error shape the OpenAPI document gives
    assert refused.json()["error"]["code"] == "invalid_host"
    assert "--allowed-hosts" in refused.json()["error"]["message"]
    messages = httpx.post(base + MESSAGES, json=anthropic(), headers={"Host": "evil.example"})
    assert messages.json()["type"] == "error"  # each dialect's own shape
    for bad in ("", "a b", "[::zz]"):
        assert httpx.get(base + "/health", headers={"Host": bad}).status_code == 400
    assert httpx.get(base + "/v1/models", headers={"Host": "localhost:8080"}).status_code == 200
    assert httpx.get(base + "/v1/models", headers={"Host": "[::1]:8080"}).status_code == 200


def test_allowed_hosts_and_cors_are_opt_in():
    settings = Settings(
        _env_file=None, allowed_hosts="kv.lan, 127.0.0.1", cors_origins="http://app.lan"
    )
    app = create_app(settings, lambda s, r: FakeEngine(s, r, eos_after=2))
    with serve_app(app) as url:
        hosted = {"Host": "kv.lan"}
        assert httpx.get(url + "/health", headers=hosted).status_code == 200
        assert httpx.get(url + "/health", headers={"Host": "localhost"}).status_code == 400
        pre = httpx.options(
            url + CHAT,
            headers={
                **hosted,
                "Origin": "http://app.lan",
                "Access-Control-Request-Method": "POST",
            },
        )
        assert pre.headers["access-control-allow-origin"] == "http://app.lan"
        other = httpx.get(url + "/health", headers={**hosted, "Origin": "http://evil.lan"})
        assert "access-control-allow-origin" not in other.headers


def test_a_web_page_from_another_origin_cannot_post_even_without_a_preflight():
    """A text/plain POST needs no CORS preflight: any page the user opened could
    mount adapters or run generations on a loopback server with no key."""
    settings = Settings(_env_file=None, cors_origins="http://app.lan")
    app = create_app(settings, lambda s, r: FakeEngine(s, r, eos_after=2))
    with serve_app(app) as url:
        sent = json.dumps(chat())
        plain = {"Content-Type": "text/plain"}
        for origin in ("http://evil.example", "null"):
            r = httpx.post(url + CHAT, content=sent, headers={**plain, "Origin": origin})
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
            r = httpx.post(url + MESSAGES, json=anthropic(), headers={"Origin": origin})
            assert r.status_code == 403 and r.json()["type"] == "error"
            r = httpx.post(
                url + "/v1/adapters", json={"id": "x", "path": "/"}, headers={"Origin": origin}
            )
            assert r.status_code == 403
        # allowed: the listed origin, the server's own pages, clients that send none
        assert (
            httpx.post(url + CHAT, json=chat(), headers={"Origin": "http://app.lan"}).status_code
            == 200
        )
        own = url.replace("localhost", "127.0.0.1")
        assert httpx.post(url + CHAT, json=chat(), headers={"Origin": own}).status_code == 200
        assert httpx.post(url + CHAT, json=chat()).status_code == 200
        # desktop apps' own schemes, and the server's own host behind a TLS proxy
        for app_origin in ("tauri://localhost", "http://tauri.localhost", "vscode-webview://abc"):
            assert (
                httpx.post(url + CHAT, json=chat(), headers={"Origin": app_origin}).status_code
                == 200
            )
        tls = url.replace("http://localhost", "https://127.0.0.1").replace("http://", "https://")
        assert httpx.post(url + CHAT, json=chat(), headers={"Origin": tls}).status_code == 200
        # reading is not guarded (CORS keeps a page from seeing the answer)
        assert (
            httpx.get(url + "/v1/models", headers={"Origin": "http://evil.example"}).status_code
            == 200
        )


def test_no_cors_headers_by_default(base):
    r = httpx.get(base + "/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_a_rebound_name_is_not_the_servers_own_page_when_any_host_is_answered():
    """Bound beyond loopback with no --allowed-hosts, any Host is answered: a page
    whose name was rebound to the server's address sent Origin == Host, passed as
    the server's own page, and drove (and read) its generations."""
    settings = Settings(_env_file=None, host="0.0.0.0")
    assert settings.host_allowlist == ["*"]
    app = create_app(settings, lambda s, r: FakeEngine(s, r, eos_after=2))
    with serve_app(app) as url:
        port = url.rsplit(":", 1)[1]
        rebound = {"Host": f"attacker.example:{port}", "Origin": f"http://attacker.example:{port}"}
        r = httpx.post(url + CHAT, json=chat(), headers=rebound)
        assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"]
        assert httpx.post(url + CHAT, json=chat()).status_code == 200  # no Origin: no page
    keyed = Settings(_env_file=None, host="0.0.0.0", api_key="k")
    app = create_app(keyed, lambda s, r: FakeEngine(s, r, eos_after=2))
    with serve_app(app) as url:  # a rebound page cannot send the key: its own /docs can
        port = url.rsplit(":", 1)[1]
        own = {"Host": f"kv.lan:{port}", "Origin": f"http://kv.lan:{port}"}
        headers = {**own, "Authorization": "Bearer k"}
        assert httpx.post(url + CHAT, json=chat(), headers=headers).status_code == 200
    named = Settings(_env_file=None, host="0.0.0.0", allowed_hosts="kv.lan, 127.0.0.1")
    app = create_app(named, lambda s, r: FakeEngine(s, r, eos_after=2))
    with serve_app(app) as url:
        own = {"Host": "kv.lan", "Origin": "http://kv.lan"}  # its own /docs, by a checked name
        assert httpx.post(url + CHAT, json=chat(), headers=own).status_code == 200


def _host_answer(allowed: str, host: str) -> int:
    from starlette.responses import PlainTextResponse
    from starlette.testclient import TestClient

    from app.middleware import HostCheckMiddleware

    hosts = Settings(_env_file=None, host="0.0.0.0", allowed_hosts=allowed).host_allowlist
    client = TestClient(HostCheckMiddleware(PlainTextResponse("ok"), hosts))
    return client.get("/health", headers={"Host": host}).status_code


@pytest.mark.parametrize(
    ("allowed", "host", "status"),
    [
        ("mybox.local:8080", "mybox.local:8080", 200),
        ("MyBox.Local:8080", "mybox.local:8080", 200),
        ("mybox.local:8080", "mybox.local:9090", 400),
        ("mybox.local:8080", "other.local:8080", 400),
        ("mybox.local:80", "mybox.local", 200),  # a default port is left out of Host
        ("mybox.local", "mybox.local:8080", 200),  # no port: any port
        ("[::1]:8080", "[::1]:8080", 200),
        ("[::1]", "[::1]:8080", 200),
        ("::1", "[::1]:8080", 200),
        ("*.example.com:8080", "a.example.com:8080", 200),
    ],
)
def test_an_allowed_host_with_a_port_matches_that_port(allowed, host, status):
    """The help says "Host header values", which carry the port: `mybox.local:8080`
    was compared with the bare name and refused every request, /health too."""
    assert _host_answer(allowed, host) == status


@pytest.mark.parametrize("item", ["http://mybox.local", "mybox.local/", "mybox:port", "[::zz]"])
def test_an_allowed_host_no_host_header_can_match_is_refused_at_start(item, capsys):
    from app.cli import main

    assert main(["serve", "--allowed-hosts", item, "--no-log-json"]) == 2
    err = capsys.readouterr().err
    assert "--allowed-hosts" in err and "mybox.local:8080" in err, err


def test_a_cors_origin_written_with_a_trailing_slash_matches():
    """Browsers send Origin without a path: "http://localhost:3000/" never matched."""
    from starlette.testclient import TestClient

    settings = Settings(_env_file=None, cors_origins="http://LocalHost:3000/, https://a.lan:443")
    assert settings.cors_allowlist == ["http://localhost:3000", "https://a.lan"]
    app = create_app(settings, lambda s, r: FakeEngine(s, r, eos_after=2))
    with TestClient(app, base_url="http://localhost") as client:
        for origin in ("http://localhost:3000", "https://a.lan"):
            pre = client.options(
                CHAT, headers={"Origin": origin, "Access-Control-Request-Method": "POST"}
            )
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
            assert client.post(CHAT, json=chat(), headers={"Origin": origin}).status_code == 200


def test_a_cors_origin_with_a_path_is_refused_at_start(capsys):
    from app.cli import main

    assert main(["serve", "--cors-origins", "http://localhost:3000/app", "--no-log-json"]) == 2
    err = capsys.readouterr().err
    assert "--cors-origins" in err and "http://localhost:3000" in err, err


def test_a_refused_preflight_is_in_the_json_error_shape():
    """Starlette refused it as text/plain "Disallowed CORS origin"; every other
    refusal is the route's own JSON error."""
    from starlette.testclient import TestClient

    settings = Settings(_env_file=None, cors_origins="http://app.lan")
    app = create_app(settings, lambda s, r: FakeEngine(s, r, eos_after=2))
    with TestClient(app, base_url="http://localhost") as client:
        asked = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
        r = client.options(CHAT, headers=asked)
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        err = r.json()["error"]
        assert err["code"] == "origin_not_allowed" and "--cors-origins" in err["message"]
        assert "access-control-allow-origin" not in r.headers
        r = client.options(MESSAGES, headers=asked)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        allowed = {**asked, "Origin": "http://app.lan"}
        assert client.options(CHAT, headers=allowed).status_code == 200


def _loopback_answer(bound: str, host: str) -> int:
    from starlette.responses import PlainTextResponse
    from starlette.testclient import TestClient

    from app.middleware import HostCheckMiddleware

    hosts = Settings(_env_file=None, host=bound).host_allowlist
    client = TestClient(HostCheckMiddleware(PlainTextResponse("ok"), hosts))
    return client.get("/health", headers={"Host": host}).status_code


@pytest.mark.parametrize(
    ("bound", "own_host"),
    [
        ("LOCALHOST", "localhost:8080"),
        ("localhost.", "localhost.:8080"),
        ("127.0.0.2", "127.0.0.2:8080"),
        ("::ffff:127.0.0.1", "[::ffff:127.0.0.1]:8080"),
        ("0:0:0:0:0:0:0:1", "[0:0:0:0:0:0:0:1]:8080"),
    ],
)
def test_every_spelling_of_loopback_keeps_the_dns_rebinding_guard(bound, own_host):
    """Loopback was recognised by exact string: --host LOCALHOST, 127.0.0.2 or
    ::ffff:127.0.0.1 answered any Host (a rebound page's too) and warned that
    anyone could use it. The address it is bound to is answered besides."""
    from app.cli import _open_bind_warning

    assert "*" not in Settings(_env_file=None, host=bound).host_allowlist
    assert _loopback_answer(bound, "evil.example:8080") == 400
    assert _loopback_answer(bound, "localhost:8080") == 200
    assert _loopback_answer(bound, own_host) == 200
    assert _open_bind_warning(Settings(_env_file=None, host=bound)) is None


@pytest.mark.parametrize("bound", ["0.0.0.0", "::", "192.168.1.5", "localhost.example", "fe80::1"])
def test_a_host_beyond_loopback_answers_any_host_and_warns_without_a_key(bound):
    from app.cli import _open_bind_warning

    assert Settings(_env_file=None, host=bound).host_allowlist == ["*"]
    assert bound in str(_open_bind_warning(Settings(_env_file=None, host=bound)))
    assert _open_bind_warning(Settings(_env_file=None, host=bound, api_key="k")) is None
