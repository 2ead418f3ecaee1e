"""The gateway's request rules decided from headers alone: which Host it answers, and which
state-changing requests a browser may not have sent on a user's behalf."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from services.common.settings import Settings
from services.gateway.guard import BrowserGuard, HostRule, split_host


def rule(**settings) -> HostRule:
    return HostRule(Settings(**settings))


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.0.0.1:8080", "localhost:1", "[::1]:9", "LOCALHOST", None]
)
def test_loopback_names_are_answered_on_any_port(host):
    assert rule().allows(host)


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8080", "127.0.0.1.evil.example", "10.0.0.5:8080", ""]
)
def test_other_hosts_are_refused_by_default(host):
    assert not rule().allows(host)


def test_allowed_hosts_add_names_with_any_or_one_port():
    r = rule(allowed_hosts=["kb.example.com", "api.example.com:443", "gw:*"])
    assert r.allows("kb.example.com") and r.allows("kb.example.com:8443")
    assert r.allows("api.example.com:443") and not r.allows("api.example.com:80")
    assert r.allows("gw:1") and not r.allows("other")
    assert rule(allowed_hosts=["*"]).allows("anything.example")


def test_a_specific_bind_address_is_answered():
    assert rule(host="10.0.0.5").allows("10.0.0.5:8080")
    assert not rule(host="0.0.0.0").allows("10.0.0.5:8080")


def test_allowed_hosts_are_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("KBMESH_ALLOWED_HOSTS", '["new.example"]')
    assert HostRule(Settings()).allows("new.example")


def test_split_host():
    assert split_host("[::1]:80") == ("[::1]", "80")
    assert split_host("[::1]") == ("[::1]", None)
    assert split_host("a.b:1") == ("a.b", "1")
    assert split_host("a.b") == ("a.b", None)


def verdict(headers: dict[str, str], cors: tuple[str, ...] = ()) -> int | None:
    guard = BrowserGuard(lambda *a: None, cors)  # type: ignore[arg-type,return-value]
    found = guard.inspect(Headers(headers={"host": "127.0.0.1:8080", **headers}))
    return found[0] if found else None


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"content-type": "application/json", "content-length": "2"}, None),
        ({"content-type": "application/json; charset=utf-8"}, None),
        ({"content-type": "application/merge-patch+json"}, None),
        ({}, None),  # no body: DELETE, a bodiless POST
        ({"content-length": "0"}, None),
        ({"content-type": "text/plain;charset=UTF-8", "content-length": "2"}, 415),
        ({"content-type": "application/x-www-form-urlencoded"}, 415),
        ({"content-type": "multipart/form-data; boundary=x"}, 415),
        ({"content-length": "2"}, 415),  # a Blob body: no type at all
        ({"transfer-encoding": "chunked"}, 415),
        ({"origin": "http://127.0.0.1:8080", "content-type": "application/json"}, None),
        ({"origin": "http://evil.example", "content-type": "application/json"}, 403),
        ({"origin": "null", "content-type": "application/json"}, 403),
        ({"origin": "http://127.0.0.1:9999", "content-type": "application/json"}, 403),
        ({"sec-fetch-site": "cross-site", "content-type": "application/json"}, 403),
        ({"sec-fetch-site": "same-site", "content-type": "application/json"}, 403),
        ({"sec-fetch-site": "same-origin", "content-type": "application/json"}, None),
        ({"sec-fetch-site": "none", "content-type": "application/json"}, None),
    ],
)
def test_browser_writes(headers, status):
    assert verdict(headers) == status


def test_configured_cors_origins_may_write():
    headers = {"origin": "https://app.example.com", "content-type": "application/json"}
    assert verdict(headers) == 403
    assert verdict(headers, ("https://app.example.com/",)) is None


def file_verdict(headers: dict[str, str]) -> int | None:
    """The verdict on a write to a route that takes file bodies (the document uploads)."""
    guard = BrowserGuard(lambda *a: None)  # type: ignore[arg-type,return-value]
    found = guard.inspect(Headers(headers={"host": "127.0.0.1:8080", **headers}), lambda: True)
    return found[0] if found else None


FORM = "multipart/form-data; boundary=x"


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"content-type": FORM, "content-length": "9"}, None),  # curl -F, the CLI
        ({"content-type": "application/pdf", "content-length": "9"}, None),  # a raw file
        ({"content-type": "text/plain;charset=UTF-8", "content-length": "9"}, None),
        ({"content-type": "application/json"}, None),
        ({"origin": "http://127.0.0.1:8080", "content-type": FORM}, None),  # the console
        ({"sec-fetch-site": "same-origin", "content-type": FORM}, None),
        ({"origin": "http://evil.example", "content-type": FORM}, 403),
        ({"origin": "null", "content-type": FORM}, 403),  # a sandboxed frame, a file: page
        ({"origin": "http://evil.example", "content-type": "text/plain"}, 403),
        ({"sec-fetch-site": "cross-site", "content-type": FORM}, 403),
        ({"sec-fetch-site": "same-site", "content-type": "text/plain"}, 403),
        ({"content-length": "9"}, 415),  # a body of no type at all
        ({"content-type": "", "content-length": "9"}, 415),
    ],
)
def test_file_uploads_take_forms_and_raw_files_only_from_their_own_origin(headers, status):
    assert file_verdict(headers) == status


@pytest.mark.parametrize(
    ("method", "path", "takes"),
    [
        ("POST", "/v1/documents", True),
        ("POST", "/v1/kbs/manuals/documents", True),
        ("POST", "/v1/kbs", False),
        ("PATCH", "/v1/documents/abc", False),
        ("DELETE", "/v1/documents", False),
        ("POST", "/v1/search", False),
        ("POST", "/api/v1/tools/kb_upload", False),
    ],
)
def test_only_the_document_upload_routes_take_file_bodies(method, path, takes):
    from services.gateway.api.files import takes_file_bodies, takes_files
    from services.gateway.app import ROUTERS

    routes = [r for router in ROUTERS for r in router.routes if takes_files(r)]
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    assert takes_file_bodies(routes, scope) is takes
