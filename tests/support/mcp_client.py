"""Helpers for driving kbmesh through the official MCP client: a real uvicorn server around
the gateway app on a free port (the MCP client needs a socket), and client sessions over
streamable HTTP and stdio."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult

from tests.support.asgi import serve_app

REPO = Path(__file__).resolve().parents[2]
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "TOKENIZERS_PARALLELISM": "false",
}


@contextlib.asynccontextmanager
async def serve_http(rt: Any) -> AsyncIterator[tuple[str, Any]]:
    """The gateway app of `rt` behind uvicorn on 127.0.0.1:<free port>; yields (base url, app)."""
    from services.runtime import gateway_app

    app = gateway_app(rt)
    async with serve_app(app) as base:
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
        env={**OFFLINE_ENV, "KBMESH_LOG_LEVEL": "WARNING", **env},
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
    assert result.is_error, result
    body = structured(result)
    assert body["status"] == "error" and body["message"], body
    assert "Traceback" not in json.dumps(body) and "Traceback" not in result.content[0].text
    if error_type is not None:
        assert body["error_type"] == error_type, body
    return body
