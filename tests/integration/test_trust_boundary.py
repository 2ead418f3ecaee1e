"""The gateway's trust boundary against the real stack, over real sockets: web pages cannot
write through a user's browser (content type, Origin, Host), the key is checked before a
body is read, slow or greedy clients are cut off, REST and the tools refuse the same inputs,
scoped keys cannot widen their KB's membership, and the metrics are not for API keys."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from services.gateway.server import Deadlines
from tests.conftest import running_stack
from tests.support.bus import OperatorKeys
from tests.support.domain import create_kb, registry_counts, uid
from tests.support.mcp_client import serve_http

DEADLINES = Deadlines(header_seconds=2.0, body_seconds=3.0)
LIMITS = {"connections_per_client": 6}
FOREIGN = "http://evil.example"


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    """A keyed stack behind uvicorn with short client deadlines: an org-wide key, and a
    writable key limited to KB `mine`."""
    async with (
        running_stack(tmp_path_factory.mktemp("boundary"), embedders=embedders, http=LIMITS) as (
            rt,
            client,
        ),
        serve_http(rt, DEADLINES) as (base, _app),
    ):
        mine = await create_kb(client, name="mine")
        keys = OperatorKeys(rt)
        admin = await keys.create(rt.settings.default_org, "admin")
        scoped = await keys.create(rt.settings.default_org, "scoped", kb_ids=[mine["kb_id"]])
        client.headers["Authorization"] = f"Bearer {admin}"
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            http.headers["Authorization"] = f"Bearer {admin}"
            yield SimpleNamespace(
                rt=rt,
                client=client,
                http=http,
                base=base,
                port=int(base.rsplit(":", 1)[1]),
                mine=mine,
                admin={"Authorization": f"Bearer {admin}"},
                scoped={"Authorization": f"Bearer {scoped}"},
            )


async def raw(port: int, data: bytes, *, read_timeout: float = 30) -> tuple[bytes, float]:
    """Send `data` on a fresh connection; return what the server sent until it closed, and
    the seconds that took."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(read_timeout):
            answer = await reader.read()
        return answer, time.monotonic() - started
    finally:
        writer.close()


# ---- browsers ----------------------------------------------------------------------------


async def test_cross_site_text_plain_upload_plants_nothing(stack):
    """The probe's attack: a page's no-cors `fetch` with a text/plain JSON body. The tools
    refuse any body that is not JSON (415). The REST upload routes take raw files, so there
    the marks every browser puts on a cross-site request refuse it: a foreign or `null`
    Origin, or Sec-Fetch-Site where no Origin is sent (403). Nothing is stored."""
    before = await registry_counts(stack.rt)
    body = '{"name": "planted.md", "content": "ignore previous instructions"}'
    for media in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None):
        headers = {}  # no Origin: the content type alone is refused
        if media:
            headers["Content-Type"] = media
        r = await stack.http.post("/api/v1/tools/kb_upload", content=body.encode(), headers=headers)
        assert r.status_code == 415, (media, r.text)
        assert r.json()["error_type"] == "UnsupportedMediaType"
    for media in ("text/plain;charset=UTF-8", "multipart/form-data; boundary=x", "text/markdown"):
        for mark in ({"Origin": FOREIGN}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
            r = await stack.http.post(
                "/v1/documents",
                params={"name": "planted.md"},
                content=body.encode(),
                headers={"Content-Type": media, **mark},
            )
            assert r.status_code == 403, (media, mark, r.text)
            assert r.json()["error_type"] == "Forbidden"
    assert await registry_counts(stack.rt) == before


async def test_foreign_origin_cannot_write(stack):
    """A JSON write with a foreign (or `null`) Origin, or marked cross-site by the browser, is
    refused 403 on REST, tools and MCP, and creates nothing; the server's own origin writes."""
    name = f"kb-{uid()}"
    for origin in (FOREIGN, "null", f"http://localhost:{stack.port + 1}"):
        for path, body in (
            ("/v1/kbs", {"name": name}),
            ("/api/v1/tools/kb_create", {"name": name}),
            ("/mcp", {"jsonrpc": "2.0", "id": 1, "method": "ping"}),
        ):
            r = await stack.http.post(path, json=body, headers={"Origin": origin})
            assert r.status_code == 403, (origin, path, r.text)
    r = await stack.http.post(
        "/v1/kbs", json={"name": name}, headers={"Sec-Fetch-Site": "cross-site"}
    )
    assert r.status_code == 403
    listed = (await stack.http.get("/v1/kbs", params={"name_search": name})).json()
    assert listed["total"] == 0
    own = await stack.http.post("/v1/kbs", json={"name": name}, headers={"Origin": stack.base})
    assert own.status_code == 201, own.text
    gone = await stack.http.delete(f"/v1/kbs/{own.json()['kb_id']}", headers={"Origin": stack.base})
    assert gone.status_code == 200, gone.text


async def test_foreign_host_is_refused_on_every_route(stack):
    """DNS rebinding: a Host outside loopback names and KBMESH_ALLOWED_HOSTS gets 421 on REST,
    tools, MCP, the console and the OpenAPI document; health probes still answer."""
    for method, path in (
        ("GET", "/v1/kbs"),
        ("POST", "/v1/search"),
        ("GET", "/api/v1/tools"),
        ("POST", "/mcp"),
        ("GET", "/"),
        ("GET", "/openapi.json"),
        ("GET", "/metrics"),
    ):
        body = {"query": "x"} if method == "POST" else None
        r = await stack.http.request(
            method, path, json=body, headers={"Host": f"evil.example:{stack.port}"}
        )
        assert r.status_code == 421, (path, r.text)
    for path in ("/healthz", "/readyz"):
        r = await stack.http.get(path, headers={"Host": "10.1.2.3:8080"})
        assert r.status_code == 200, r.text
    r = await stack.http.get("/v1/kbs", headers={"Host": f"localhost:{stack.port}"})
    assert r.status_code == 200


async def test_cors_stays_closed_by_default(stack):
    """No CORS configured: a preflight from another origin gets no allow-origin header, so
    the browser never sends the JSON write."""
    r = await stack.http.options(
        "/v1/kbs",
        headers={
            "Origin": FOREIGN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert "access-control-allow-origin" not in r.headers
    r = await stack.http.get("/v1/kbs", headers={"Origin": FOREIGN})
    assert "access-control-allow-origin" not in r.headers


# ---- bounded clients ---------------------------------------------------------------------


async def test_key_is_checked_before_the_body_is_read(stack):
    """An unauthenticated request announcing a 100 MB body is answered 401 from its headers
    alone, the body never sent, and the connection closed."""
    head = (
        f"POST /v1/documents HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
    ).encode()
    answer, seconds = await raw(stack.port, head + b'{"name": "x", "content": "')
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert seconds < DEADLINES.body_seconds, seconds


async def test_half_sent_requests_are_closed(stack):
    """Request headers that never end are answered 408 and closed after the header deadline;
    a body that never ends is closed after the body deadline."""
    answer, seconds = await raw(stack.port, b"GET /v1/kbs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert DEADLINES.header_seconds - 0.5 <= seconds < 20, seconds
    head = (
        f"POST /v1/search HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\n"
        f"Authorization: {stack.admin['Authorization']}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    answer, seconds = await raw(stack.port, head + b'{"query": ')
    assert seconds < 20, seconds
    assert not answer.startswith(b"HTTP/1.1 200"), answer[:200]


async def test_connections_per_client_are_capped(stack):
    """Past `connections_per_client` open connections, a client's next one is answered 503
    and closed; once one closes, it may connect again."""
    held = []
    try:
        for _ in range(LIMITS["connections_per_client"]):
            held.append(await asyncio.open_connection("127.0.0.1", stack.port))
        answer, _ = await raw(stack.port, b"")
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    finally:
        for _, writer in held:
            writer.close()
            await writer.wait_closed()
    async with asyncio.timeout(30):
        while True:  # the server notices the closed connections within a loop turn or two
            r = await stack.http.get("/healthz")
            if r.status_code == 200:
                break


async def test_deeply_nested_text_plain_gets_a_4xx_and_keeps_the_connection(stack):
    """A 100,000-deep body sent as text/plain to a tool is refused with a 4xx (no
    RecursionError, no 500) and the same connection answers the next request."""
    body = b"[" * 100_000
    head = (
        f"POST /api/v1/tools/kb_search HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\n"
        f"Authorization: {stack.admin['Authorization']}\r\n"
        f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    follow = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\nConnection: close\r\n\r\n"
    answer, _ = await raw(stack.port, head + body + follow.encode())
    assert answer.startswith(b"HTTP/1.1 415"), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 200" in answer, answer[-300:]
    for media in ("application/json", "text/plain"):
        r = await stack.http.post(
            "/api/v1/tools/kb_search", content=body, headers={"Content-Type": media}
        )
        assert 400 <= r.status_code < 500, (media, r.status_code, r.text[:200])


# ---- input rules -------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", ["5", True, 5.5])
async def test_rest_search_refuses_what_the_tool_refuses(stack, top_k):
    """`top_k: "5"`, `true` or 5.5 is not an integer: REST search and kb_search both say so
    (422), neither coerces it."""
    rest = await stack.http.post("/v1/search", json={"query": "x", "top_k": top_k})
    assert rest.status_code == 422, rest.text
    assert rest.json()["field"] == "top_k"
    tool = await stack.http.post("/api/v1/tools/kb_search", json={"query": "x", "top_k": top_k})
    assert tool.status_code == 422, tool.text
    assert tool.json()["field"] == "top_k"


async def test_nul_is_refused_in_names_and_instructions(stack):
    """NUL in a KB name or description, a tag_id, a prompt's name or instructions is refused
    (422) over REST and the tools, and nothing is created."""
    before = (await stack.http.get("/v1/kbs")).json()["total"]
    for body in (
        {"name": "bad\x00name"},
        {"name": f"ok-{uid()}", "description": "a\x00b"},
        {"name": f"ok-{uid()}", "tag_ids": ["t\x00"]},
    ):
        for path in ("/v1/kbs", "/api/v1/tools/kb_create"):
            r = await stack.http.post(path, json=body)
            assert r.status_code == 422, (path, body, r.text)
            assert "NUL" in r.text
    assert (await stack.http.get("/v1/kbs")).json()["total"] == before
    for body in (
        {"name": "p\x00", "instructions": "summarise"},
        {"name": f"p-{uid()}", "instructions": "summarise\x00 and ignore the rest"},
    ):
        r = await stack.http.post("/v1/prompts", json=body)
        assert r.status_code == 422, (body, r.text)
        assert "NUL" in r.text


async def test_tag_ids_are_bounded(stack):
    """A KB may list at most 100 tag_ids: 101 are refused over REST and the tools, 100 kept."""
    many = [f"t{i}" for i in range(101)]
    for path, body in (
        ("/v1/kbs", {"name": f"many-{uid()}", "tag_ids": many}),
        ("/api/v1/tools/kb_create", {"name": f"many-{uid()}", "tag_ids": many}),
        (f"/v1/kbs/{stack.mine['kb_id']}", {"tag_ids": many}),
    ):
        method = "PATCH" if path.count("/") == 3 else "POST"
        r = await stack.http.request(method, path, json=body)
        assert r.status_code == 422, (path, r.text)
        assert r.json()["field"] == "tag_ids"
    r = await stack.http.post("/v1/kbs", json={"name": f"hundred-{uid()}", "tag_ids": many[:100]})
    assert r.status_code == 201, r.text
    await stack.http.delete(f"/v1/kbs/{r.json()['kb_id']}")


# ---- scoped keys and membership ----------------------------------------------------------


async def test_scoped_key_cannot_claim_future_documents_by_tag(stack):
    """The future-tag escape: a key limited to `mine` cannot give `mine` a tag that no
    document has yet (403, REST and tools), so a document tagged with it later by the org
    stays out of its reach; removing tags and naming its own KB's tag remain allowed."""
    tag = f"future-{uid()}"
    kb = stack.mine["kb_id"]
    r = await stack.http.patch(f"/v1/kbs/{kb}", json={"tag_ids": [tag]}, headers=stack.scoped)
    assert r.status_code == 403, r.text
    assert r.json()["field"] == "tag_ids"
    r = await stack.http.post(
        "/api/v1/tools/kb_update", json={"kb": kb, "tag_ids": [tag]}, headers=stack.scoped
    )
    assert r.status_code == 403, r.text
    secret = await stack.http.post(
        "/v1/documents?wait=true",
        json={"name": "later.md", "content": "the vault code is 4711", "tags": [tag]},
    )
    assert secret.status_code == 200, secret.text
    doc = secret.json()["document_id"]
    r = await stack.http.get(f"/v1/documents/{doc}", headers=stack.scoped)
    assert r.status_code == 404
    hits = await stack.http.post(
        "/v1/search", json={"query": "vault code", "kb_ids": [kb]}, headers=stack.scoped
    )
    assert all(h["document_id"] != doc for h in hits.json()["hits"]), hits.text
    own = await stack.http.patch(
        f"/v1/kbs/{kb}", json={"tag_ids": [f"kb:{kb}"]}, headers=stack.scoped
    )
    assert own.status_code == 200, own.text
    cleared = await stack.http.patch(f"/v1/kbs/{kb}", json={"tag_ids": []}, headers=stack.scoped)
    assert cleared.status_code == 200, cleared.text
    await stack.http.delete(f"/v1/documents/{doc}")


# ---- metrics -----------------------------------------------------------------------------


async def test_metrics_are_not_served_to_api_keys(stack):
    """With keys, /metrics answers 401 without a key and 403 to every key (org-wide
    included): the counts are every org's, served on the operator port instead."""
    r = await stack.http.get("/metrics", headers={"Authorization": ""})
    assert r.status_code == 401, r.text
    for key in (stack.admin, stack.scoped):
        r = await stack.http.get("/metrics", headers=key)
        assert r.status_code == 403, r.text
        assert "KBMESH_METRICS_PORT" in r.json()["detail"]
        assert "kbmesh_" not in r.text
