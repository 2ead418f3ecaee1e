"""Helpers for driving kbmesh through the official MCP client: a real uvicorn server around
the gateway app on a free port (the MCP client needs a socket), and client sessions over
streamable HTTP and stdio."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import httpx2
from mcp import Client, ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult

from services.gateway.mcp import ERROR_META
from services.gateway.server import DEADLINES, Deadlines
from tests.support.asgi import serve_app
from tests.support.bus import bus_env

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "TOKENIZERS_PARALLELISM": "false",
}


@contextlib.asynccontextmanager
async def serve_http(
    rt: Any, deadlines: Deadlines = DEADLINES, port: int | None = None
) -> AsyncIterator[tuple[str, Any]]:
    """The gateway app of `rt` behind uvicorn on 127.0.0.1:<port, default a free one>, as
    `kbmesh up` serves it (`rt.settings.http`, the client `deadlines`); yields (base url,
    app)."""
    from services.cli.runtime import gateway_app
    from services.gateway.bodylimit import largest_body_bytes

    app = gateway_app(rt)
    largest = largest_body_bytes(rt.settings)
    async with serve_app(
        app, limits=rt.settings.http, deadlines=deadlines, max_body_bytes=largest, port=port
    ) as base:
        yield base, app


@contextlib.asynccontextmanager
async def http_session(base_url: str, api_key: str | None = None) -> AsyncIterator[ClientSession]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    timeout = httpx2.Timeout(120.0, read=300.0)
    async with (
        httpx2.AsyncClient(headers=headers, timeout=timeout) as http,
        streamable_http_client(f"{base_url}/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


@contextlib.asynccontextmanager
async def sdk_client(
    base_url: str, api_key: str | None = None, *, mode: str = "auto"
) -> AsyncIterator[Client]:
    """The official SDK's `Client` over streamable HTTP, negotiating as `mode` says: "auto"
    (what the SDK does by default: the newest revision both sides speak) or "legacy" (the
    initialize handshake of the revisions before 2026-07-28)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    timeout = httpx2.Timeout(120.0, read=300.0)
    async with (
        httpx2.AsyncClient(headers=headers, timeout=timeout) as http,
        Client(streamable_http_client(f"{base_url}/mcp", http_client=http), mode=mode) as client,
    ):
        yield client


def kbmesh_command() -> list[str]:
    script = Path(sys.executable).parent / "kbmesh"
    return [str(script)] if script.exists() else [sys.executable, "-m", "services.cli"]


@contextlib.asynccontextmanager
async def stdio_session(
    args: list[str], env: dict[str, str], errlog: Any = None
) -> AsyncIterator[ClientSession]:
    """`kbmesh mcp ARGS` as a subprocess speaking MCP on its stdin/stdout."""
    command, *prefix = kbmesh_command()
    params = StdioServerParameters(
        command=command,
        args=[*prefix, "mcp", *args],
        cwd=str(REPO),
        # The SDK passes on only a few variables: the code under test must be this tree's.
        env={**OFFLINE_ENV, "PYTHONPATH": str(REPO), "KBMESH_LOG_LEVEL": "WARNING", **env},
    )
    async with (
        stdio_client(params, errlog=errlog or sys.stderr) as (read, write),
        ClientSession(read, write, read_timeout_seconds=180) as session,
    ):
        await session.initialize()
        yield session


def structured(result: CallToolResult) -> dict[str, Any]:
    """The structured result, checked against the text content that carries the same call."""
    assert isinstance(result.structured_content, dict), result
    assert result.content and result.content[0].type == "text"
    return result.structured_content


def ok(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content[0].text if result.content else result
    return structured(result)


def failed(result: CallToolResult, error_type: str | None = None) -> dict[str, Any]:
    """The error of a failed call. Errors carry no structured content (a strict client checks
    it against the output schema); the message is the text content, and error_type, message
    and field travel in `_meta`."""
    assert result.is_error, result
    assert result.structured_content is None, result.structured_content
    assert result.content and result.content[0].type == "text"
    text = result.content[0].text
    body = dict((result.meta or {})[ERROR_META])
    assert body["status"] == "error" and body["message"] and body["message"] in text, body
    assert "Traceback" not in json.dumps(body) and "Traceback" not in text
    if error_type is not None:
        assert body["error_type"] == error_type, body
    return body


TRANSPORTS = ("http", "stdio")


@contextlib.asynccontextmanager
async def session_over(
    transport: str, rt: Any, base_url: str, data_dir: Path
) -> AsyncIterator[ClientSession]:
    """A client session with the stack of `rt`: over streamable HTTP to its app at `base_url`,
    or over stdio to a `kbmesh mcp` subprocess connected to its NATS, with both toolsets."""
    if transport == "http":
        async with http_session(base_url) as session:
            yield session
        return
    env = {
        **bus_env(rt),
        "KBMESH_MCP_TOOLSETS": "core,compat",
        "KBMESH_DATA_DIR": str(data_dir),
    }
    with open(data_dir / "stdio-stderr.log", "w") as errlog:
        async with stdio_session([], env, errlog) as session:
            yield session


@contextlib.asynccontextmanager
async def held(cm: contextlib.AbstractAsyncContextManager[T]) -> AsyncIterator[T]:
    """Enters and exits `cm` in one task of its own, so a module-scoped fixture can hold an
    MCP session (anyio cancel scopes must not cross tasks; fixtures set up and tear down in
    different ones)."""
    entered: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()

    async def hold() -> None:
        try:
            async with cm as value:
                entered.set_result(value)
                await stop.wait()
        except BaseException as err:
            if not entered.done():
                entered.set_exception(err)
            raise

    task = asyncio.create_task(hold())
    try:
        yield await entered
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await task


TS_CLIENT = REPO / "tests" / "mcp_ts"


def ts_sdk_missing() -> str | None:
    """Why the TypeScript SDK cannot run here, or None when it can."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not (TS_CLIENT / "node_modules" / "@modelcontextprotocol" / "sdk").is_dir():
        return (
            "the TypeScript MCP SDK is not installed in tests/mcp_ts "
            "(`make test` runs `npm ci` there; it needs node 18+ and npm)"
        )
    return None


async def ts_call_tool(
    transport: str, target: str, tool: str, arguments: dict[str, Any], env: dict[str, str]
) -> dict[str, Any]:
    """One tool call with the official TypeScript SDK (tests/mcp_ts/call_tool.mjs): returns
    `{"raised": <the SDK's error message> | None, "result": <CallToolResult JSON> | None}`."""
    proc = await asyncio.create_subprocess_exec(
        "node",
        str(TS_CLIENT / "call_tool.mjs"),
        transport,
        target,
        tool,
        json.dumps(arguments),
        cwd=str(TS_CLIENT),
        env={**os.environ, **OFFLINE_ENV, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=180)
    assert proc.returncode == 0, err.decode()[-2000:]
    outcome: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return outcome


async def kbmesh_ingest(base: str, *args: str | Path) -> tuple[int, list[str]]:
    """Run `kbmesh ingest` in its own process; returns its exit status and output lines."""
    proc = await asyncio.create_subprocess_exec(
        *kbmesh_command(),
        "ingest",
        *map(str, args),
        "--api",
        base,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO)},
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=300)
    lines = out.decode().strip().splitlines()
    assert proc.returncode is not None
    return proc.returncode, lines
