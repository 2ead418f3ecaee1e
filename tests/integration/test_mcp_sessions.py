"""MCP sessions over streamable HTTP belong to the API key that opened them: another key can
neither use nor end one (the SDK answers as if it did not exist), and one key cannot hold
more than its share of the server's sessions. Driven by the official MCP client against a
real stack behind a real uvicorn socket."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import httpx2
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from services.cli.runtime import api_keys
from services.gateway.app import create_app
from services.gateway.mcp import create_mcp
from tests.conftest import running_stack
from tests.support.asgi import serve_app
from tests.support.bus import OperatorKeys
from tests.support.mcp_client import ok, serve_http

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "raw", "version": "1"},
    },
}
ACCEPT = {"Accept": "application/json, text/event-stream"}
SESSION = "Mcp-Session-Id"


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    """A stack with an org admin key, a second org-wide key and a read-only key."""
    async with (
        running_stack(tmp_path_factory.mktemp("mcp-sessions"), embedders=embedders) as (rt, client),
        serve_http(rt) as (base, _app),
    ):
        keys = OperatorKeys(rt)
        org = rt.settings.default_org
        yield SimpleNamespace(
            rt=rt,
            client=client,
            base=base,
            admin=await keys.create(org, "admin"),
            colleague=await keys.create(org, "colleague"),
            reader=await keys.create(org, "reader", read_only=True),
        )


@contextlib.asynccontextmanager
async def opened(base: str, key: str) -> AsyncIterator[tuple[ClientSession, str]]:
    """An initialised session of the official client with `key`, and the id the server gave
    it (read from the response that carried it)."""
    seen: list[str] = []

    async def session_id(response: httpx2.Response) -> None:
        if SESSION.lower() in response.headers:
            seen.append(response.headers[SESSION.lower()])

    async with (
        httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx2.Timeout(60.0, read=120.0),
            event_hooks={"response": [session_id]},
        ) as http,
        streamable_http_client(f"{base}/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session, seen[0]


def bearer(key: str, session_id: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}", **ACCEPT}
    if session_id is not None:
        headers[SESSION] = session_id
    return headers


async def test_another_key_can_neither_use_nor_end_a_session(stack):
    """A session opened with the admin's key: a read-only key and a second org-wide key that
    present its id get 404 on POST (a tool call), on GET (the event stream) and on DELETE,
    exactly as for an unknown session; the admin's session keeps working, and its own key
    ends it (then its id is unknown to everyone)."""
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "kb_list"}}
    async with (
        opened(stack.base, stack.admin) as (session, session_id),
        httpx.AsyncClient(timeout=30) as http,
    ):
        for other in (stack.reader, stack.colleague):
            r = await http.delete(f"{stack.base}/mcp", headers=bearer(other, session_id))
            assert r.status_code == 404, r.text
            assert r.json()["error"]["message"] == "Session not found"
            r = await http.post(f"{stack.base}/mcp", json=call, headers=bearer(other, session_id))
            assert r.status_code == 404, r.text
            async with http.stream(
                "GET", f"{stack.base}/mcp", headers=bearer(other, session_id)
            ) as stream:
                assert stream.status_code == 404
        # The session survived every attempt, with its owner's rights.
        listed = ok(await session.call_tool("kb_list", {}))
        assert "items" in listed
        r = await http.delete(f"{stack.base}/mcp", headers=bearer(stack.admin, session_id))
        assert r.status_code == 200, r.text
        for key in (stack.admin, stack.reader):
            r = await http.post(f"{stack.base}/mcp", json=call, headers=bearer(key, session_id))
            assert r.status_code == 404, r.text


@contextlib.asynccontextmanager
async def gateway_with_session_cap(rt: Any, cap: int) -> AsyncIterator[str]:
    """The gateway app of `rt`, whose MCP server lets one key hold `cap` sessions, behind
    uvicorn; yields its base URL."""
    keys = api_keys(rt)
    mcp = create_mcp(rt.gateway, keys=keys, sessions_per_key=cap)
    app = create_app(rt.gateway, keys, mcp=mcp, ready=rt.ready)
    async with serve_app(app, limits=rt.settings.http) as base:
        yield base


async def test_one_key_cannot_hold_more_than_its_share_of_sessions(stack):
    """With two sessions per key: the admin's key opens two, a third is refused with 429
    and a message naming the limit and the remedy, while another key still opens a session
    and calls tools; once the admin ends one of its sessions, it may open another. Openings
    sent all at once by one key are held to the cap as well."""
    async with (
        gateway_with_session_cap(stack.rt, 2) as base,
        opened(base, stack.admin) as (s1, _),
        opened(base, stack.admin) as (_s2, id2),
        httpx.AsyncClient(timeout=30) as http,
    ):
        r = await http.post(f"{base}/mcp", json=INITIALIZE, headers=bearer(stack.admin))
        assert r.status_code == 429, r.text
        body = r.json()
        assert body["status"] == "error" and body["error_type"] == "TooManySessions", body
        assert "2 MCP sessions" in body["message"] and "DELETE" in body["message"], body
        assert SESSION.lower() not in r.headers

        async with opened(base, stack.reader) as (other, _):
            assert "items" in ok(await other.call_tool("kb_list", {}))
        assert "items" in ok(await s1.call_tool("kb_list", {}))

        r = await http.delete(f"{base}/mcp", headers=bearer(stack.admin, id2))
        assert r.status_code == 200, r.text
        r = await http.post(f"{base}/mcp", json=INITIALIZE, headers=bearer(stack.admin))
        assert r.status_code == 200, r.text
        assert r.headers[SESSION.lower()]

        # All at once: the cap is counted where the SDK admits a session, under its lock.
        rs = await asyncio.gather(
            *(
                http.post(f"{base}/mcp", json=INITIALIZE, headers=bearer(stack.colleague))
                for _ in range(6)
            )
        )
        assert sorted(r.status_code for r in rs) == [200, 200, 429, 429, 429, 429]
