"""`kbmesh mcp --api URL`: MCP over stdio for a desktop agent whose kbmesh runs elsewhere and is
reached over HTTP only (no NATS, no data directory on this machine).

The process is a relay, not a second implementation: it opens one MCP session to the
stack's `/mcp` (streamable HTTP, the API key as a bearer token) and answers the agent's
tool requests (`tools/list`, `tools/call`) and resource requests (`resources/list`,
`resources/templates/list`, `resources/read`) with what that session answers, so every rule
of the stack (scope, input rules, errors) applies unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx2
import mcp_types as types
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

log = logging.getLogger("kbmesh.mcp")
# The MCP SDK's own timeouts: uploads that wait and answers take longer than 5 s.
TIMEOUT = httpx2.Timeout(30.0, read=300.0)


async def relay(api: str, api_key: str | None) -> None:
    """Serve MCP on stdin/stdout, relaying every tool and resource request to the kbmesh at
    `api`."""
    url = f"{api.rstrip('/')}/mcp"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with (
        httpx2.AsyncClient(headers=headers, timeout=TIMEOUT) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as remote,
    ):
        info = await remote.initialize()

        async def list_tools(
            _ctx: Any, params: types.PaginatedRequestParams | None
        ) -> types.ListToolsResult:
            return await remote.list_tools(params=params)

        async def call_tool(_ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
            return await remote.call_tool(params.name, params.arguments)

        async def list_resources(
            _ctx: Any, params: types.PaginatedRequestParams | None
        ) -> types.ListResourcesResult:
            return await remote.list_resources(params=params)

        async def list_resource_templates(
            _ctx: Any, params: types.PaginatedRequestParams | None
        ) -> types.ListResourceTemplatesResult:
            return await remote.list_resource_templates(params=params)

        async def read_resource(
            _ctx: Any, params: types.ReadResourceRequestParams
        ) -> types.ReadResourceResult:
            return await remote.read_resource(params.uri)

        server: Server[Any] = Server(
            info.server_info.name,
            version=info.server_info.version,
            instructions=info.instructions,
            on_list_tools=list_tools,
            on_call_tool=call_tool,
            on_list_resources=list_resources,
            on_list_resource_templates=list_resource_templates,
            on_read_resource=read_resource,
        )
        log.info("mcp_stdio_ready api=%s relay=true", api)
        async with stdio_server() as (stdin, stdout):
            await server.run(stdin, stdout, server.create_initialization_options())
