"""REST: every MCP tool as `POST /api/v1/tools/<name>` (the same JSON in, the same JSON out
as the MCP call's structured result) and `GET /api/v1/tools` with each tool's schemas."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from services.common.bus.client import BUS_UNAVAILABLE, unavailable
from services.common.domain.errors import InvalidInput, KbmeshError, NotFound
from services.gateway.api.deps import get_principal
from services.gateway.mcp import KbmeshMCP
from services.gateway.problems import RETRY_AFTER
from services.gateway.tools import ToolErrorResult, error_outcome, run_tool


class ToolInfo(BaseModel):
    name: str
    title: str
    toolsets: list[str] = Field(description="core, compat or both")
    description: str
    read_only: bool
    destructive: bool
    input_schema: dict[str, Any]
    output_schema: dict[str, Any]


class ToolList(BaseModel):
    tools: list[ToolInfo]
    error_schema: dict[str, Any] = Field(description="the body of every failed call")


def create_router(mcp_server: KbmeshMCP) -> APIRouter:
    router = APIRouter(prefix="/api/v1/tools", tags=["tools"])
    specs = mcp_server.tools

    @router.get("")
    async def list_tools() -> ToolList:
        """The tools this server offers (KBMESH_MCP_TOOLSETS), with input and output schemas."""
        return ToolList(
            tools=[
                ToolInfo(
                    name=s.name,
                    title=s.title,
                    toolsets=list(s.toolsets),
                    description=s.description,
                    read_only=s.read_only,
                    destructive=s.destructive,
                    input_schema=s.input_schema,
                    output_schema=s.output_schema,
                )
                for s in specs.values()
            ],
            error_schema=ToolErrorResult.model_json_schema(),
        )

    @router.post("/{name}")
    async def call_tool(name: str, request: Request) -> JSONResponse:
        """Run one tool. The body is the tool's arguments (its input_schema); the answer is its
        structured result, or `{status: "error", error_type, message}` with a 4xx/5xx."""
        spec = specs.get(name)
        if spec is None:
            outcome = error_outcome(
                NotFound(f"unknown tool {name!r}; GET /api/v1/tools lists them", field="name")
            )
        else:
            try:
                principal = await get_principal(request, request.headers.get("authorization"))
                arguments = tool_arguments(await request.body())
            except KbmeshError as err:
                outcome = error_outcome(err)
            except BUS_UNAVAILABLE as err:
                outcome = error_outcome(unavailable(err))
            else:
                outcome = await run_tool(spec, mcp_server.service, principal, arguments)
        headers = RETRY_AFTER if outcome.status_code == 503 else None
        return JSONResponse(outcome.body, status_code=outcome.status_code, headers=headers)

    return router


def tool_arguments(raw: bytes) -> dict[str, Any]:
    """A tool call's body: a JSON object of arguments (empty body: none). The mock parses
    with this too, so both refuse the same bodies."""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise InvalidInput(f"the body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object of the tool's arguments")
    return body
