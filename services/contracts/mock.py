"""`kbmesh mock`: the contract examples served as a kbmesh gateway — REST under /v1, the tools
under /api/v1/tools and MCP at /mcp — for teams that build against kbmesh before a stack runs.

No NATS, no store, no model. Every request is first held to its JSON Schema from the contracts,
without type coercion (a 422 problem, or a tool error, when it does not match), so a client
that satisfies the mock satisfies the gateway. Every answer is an example of
`services.contracts.examples`, the same that `contracts/` holds. Tool calls then take the
gateway's own path (`run_tool`: the input model's checks, the result dumped and rendered as
the gateway does), with the tool's work replaced by the example whose arguments match best.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from jsonschema import Draft202012Validator
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import Context
from mcp_types import CallToolResult, ListResourcesResult, PaginatedRequestParams
from pydantic import BaseModel, ValidationError
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.common.domain.errors import InvalidInput, KbmeshError, NotFound
from services.common.settings import Settings
from services.contracts.examples import RestExample, ToolExample
from services.contracts.export import (
    LIST_TOOLS,
    Contracts,
    Operation,
    build,
    request_json,
    response_json,
    schema_errors,
    validator,
)
from services.gateway.api.files import is_json
from services.gateway.api.tools import tool_arguments
from services.gateway.auth import Principal
from services.gateway.mcp import KbmeshMCP, MountRoot, call_result
from services.gateway.problems import TOOLS_PATH, ProblemFieldError, problem
from services.gateway.service.resources import ResourceText
from services.gateway.tools import (
    TOOLSETS,
    ToolOutcome,
    ToolSpec,
    error_outcome,
    run_tool,
    tools_for,
)

# What pydantic (and so the gateway) reads as a boolean query parameter.
BOOLEANS = {
    **dict.fromkeys(("true", "1", "yes", "on", "t", "y"), True),
    **dict.fromkeys(("false", "0", "no", "off", "f", "n"), False),
}


class NoExample(KbmeshError):
    status_code = 501
    error_type = "NotImplemented"


class MockTools:
    """The mock's tools: arguments held to the input schema, then the gateway's `run_tool`."""

    def __init__(self, specs: dict[str, ToolSpec], principal: Principal) -> None:
        self.specs = specs
        self.principal = principal
        self.checks = {name: validator(s.input_schema) for name, s in specs.items()}

    def refusal(self, name: str, arguments: Mapping[str, Any] | None) -> ToolOutcome | None:
        check = self.checks.get(name)
        errors = schema_errors(check, dict(arguments or {})) if check is not None else []
        return error_outcome(_invalid(errors)) if errors else None

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        spec = self.specs.get(name)
        if spec is None:
            return error_outcome(
                NotFound(f"unknown tool {name!r}; GET /api/v1/tools lists them", field="name")
            )
        refused = self.refusal(name, arguments)
        if refused is not None:
            return refused
        return await run_tool(spec, None, self.principal, arguments)  # type: ignore[arg-type]


class MockMCP(KbmeshMCP):
    """The gateway's MCP server over the mock's tools (same names, schemas and annotations)."""

    def __init__(self, settings: Settings, tools: MockTools) -> None:
        super().__init__(
            None,  # type: ignore[arg-type]  # the mock's tools answer from examples
            settings,
            tools.specs,
            keys=None,
            principal=tools.principal,
        )
        self.mock_tools = tools

    async def call_tool(  # type: ignore[override]
        self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None
    ) -> CallToolResult:
        refused = self.mock_tools.refusal(name, arguments)
        if refused is None:
            return await super().call_tool(name, arguments, context)
        return call_result(refused)

    # The examples hold no documents: the mock lists no resources and reads none, while the
    # links in its tool results are the gateway's (the same examples, the same addresses).
    async def list_resource_page(
        self, ctx: ServerRequestContext[Any], params: PaginatedRequestParams
    ) -> ListResourcesResult:
        return ListResourcesResult(resources=[])

    async def _read(self, principal: Principal, address: str) -> ResourceText:
        raise NotFound(
            f"resource {address[:200]!r} not found: the mock serves the contract examples, "
            "which hold no documents or knowledge bases to read"
        )


def create_mock_app(
    toolsets: Sequence[str] = TOOLSETS,
    settings: Settings | None = None,
    contracts: Contracts | None = None,
) -> FastAPI:
    contracts = contracts or build()
    settings = settings or Settings()
    specs = {
        name: dataclasses.replace(spec, fn=_from_examples(name, contracts.tool_examples[name]))
        for name, spec in tools_for(list(toolsets)).items()
        if name in contracts.tools
    }
    tools = MockTools(specs, Principal(org_id=settings.default_org))
    mcp = MockMCP(settings, tools)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with mcp.session_manager.run():
            yield

    app = FastAPI(title="kbmesh mock", lifespan=lifespan)
    document = copy.deepcopy(contracts.openapi)
    document["info"]["title"] = "kbmesh (mock: answers with the contract examples)"
    app.openapi = lambda: document  # type: ignore[method-assign]  # the contract, not the routes

    for key, op in contracts.operations.items():
        if op.path.startswith(TOOLS_PATH):
            continue
        example = contracts.rest_examples.get(key)
        app.router.routes.append(
            Route(op.path, _rest_endpoint(contracts, op, example), methods=[op.method])
        )
    listed = contracts.rest_examples.get(LIST_TOOLS)
    tool_list = response_json(listed.response) if listed else {"tools": []}
    tool_list = {**tool_list, "tools": [t for t in tool_list["tools"] if t["name"] in specs]}

    async def list_tools(request: Request) -> Response:
        return JSONResponse(tool_list)

    async def call_tool(request: Request) -> Response:
        try:
            arguments = tool_arguments(await request.body())
        except InvalidInput as err:
            outcome = error_outcome(err)
        else:
            outcome = await tools.call(request.path_params["name"], arguments)
        return JSONResponse(outcome.body, status_code=outcome.status_code)

    app.router.routes.append(Route(TOOLS_PATH, list_tools, methods=["GET"]))
    app.router.routes.append(Route(TOOLS_PATH + "/{name}", call_tool, methods=["POST"]))

    mcp_http = mcp.streamable_http_app(streamable_http_path="/")
    app.router.routes.append(
        Route("/mcp", MountRoot(mcp_http, "/mcp"), methods=["GET", "POST", "DELETE"])
    )
    app.mount("/mcp", mcp_http)
    return app


async def serve_mock(host: str, port: int, toolsets: Sequence[str] = TOOLSETS) -> None:
    """`kbmesh mock`: the mock app behind uvicorn until interrupted."""
    import uvicorn

    app = create_mock_app(toolsets, Settings(host=host, port=port))
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    )
    base = f"http://{host}:{port}"
    print("kbmesh mock: every answer is a contract example (contracts/)", flush=True)
    print(f"  REST     {base}/v1", flush=True)
    print(f"  docs     {base}/docs", flush=True)
    print(f"  tools    {base}/api/v1/tools", flush=True)
    print(f"  MCP      {base}/mcp", flush=True)
    await server.serve()


# ---- tools ----------------------------------------------------------------------------------


def _from_examples(
    name: str, examples: list[ToolExample]
) -> Callable[[Any, Principal, BaseModel], Awaitable[BaseModel]]:
    async def answer(service: Any, principal: Principal, inp: BaseModel) -> BaseModel:
        if not examples:
            raise NoExample(f"the mock has no example for {name}; add one to the contracts")
        return _echo(_closest(examples, inp), inp)

    return answer


# What a result says was deleted; an example vouches for deleting only what it names.
DELETED = {
    "deleted_count": 0,
    "deletedCount": 0,
    "document_ids": [],
    "status": "not_found",
    "title": None,
    "message": "nothing matches; nothing was deleted",
}


def _echo(example: ToolExample, inp: BaseModel) -> BaseModel:
    """The example's result, saying what this call asked: result fields named like one of
    the call's arguments (a sourceId, a uri, a query, a collection) take the call's values,
    and a delete of something the example does not name deleted nothing."""
    output = example.output
    shown = output.model_dump()
    given = example.input.model_dump(exclude_unset=True)
    # Only what the example itself shows echoed (tags, say, come back with more in them).
    echoed = {k for k, v in given.items() if k in shown and shown[k] == v}
    update = {k: v for k, v in inp.model_dump(exclude_unset=True).items() if k in echoed}
    deleted = shown.get("deleted_count") or shown.get("deletedCount")
    if deleted and request_json(inp) != request_json(example.input):
        update.update({k: v for k, v in DELETED.items() if k in shown})
    if not update:
        return output
    try:
        return type(output).model_validate({**shown, **update})
    except ValidationError:
        return output  # an argument the result holds in another shape: the example's own


def _closest(examples: list[ToolExample], inp: BaseModel) -> ToolExample:
    """The example sharing most argument values with the call (the first on a tie), so e.g.
    manageKnowledge answers each `operation` with its own example."""
    asked = request_json(inp)

    def shared(example: ToolExample) -> int:
        given = request_json(example.input)
        return sum(1 for k, v in asked.items() if k in given and given[k] == v)

    return max(examples, key=shared)


def _invalid(errors: list[ProblemFieldError]) -> InvalidInput:
    detail = "; ".join(f"{e.field}: {e.message}" if e.field else e.message for e in errors)
    return InvalidInput(f"invalid arguments: {detail}", field=errors[0].field or None)


# ---- REST -----------------------------------------------------------------------------------


def _rest_endpoint(
    contracts: Contracts, op: Operation, example: RestExample | None
) -> Callable[[Request], Awaitable[Response]]:
    params = [p for p in op.spec.get("parameters", []) if p["in"] in ("path", "query")]
    param_checks = {p["name"]: contracts.validator(p.get("schema", {})) for p in params}
    body_schema = contracts.request_body_schema(op.key)
    body_check = contracts.validator(body_schema) if body_schema is not None else None
    body_required = bool(op.spec.get("requestBody", {}).get("required"))
    # The upload routes take a file too (a form, a raw body): its bytes are the client's own.
    takes_files = set(op.spec.get("requestBody", {}).get("content", {})) - {"application/json"}
    # The model the example body was written in: its cross-field checks (which JSON Schema
    # cannot say) apply too, as they do in the gateway.
    body_model = type(example.body) if example and example.body is not None else None

    async def endpoint(request: Request) -> Response:
        errors = _param_errors(params, param_checks, request.path_params, request.query_params)
        if body_check is not None and not (
            takes_files and not is_json(request.headers.get("content-type"))
        ):
            errors += await _body_errors(request, body_check, body_model, body_required)
        if errors:
            detail = "; ".join(f"{e.field}: {e.message}" for e in errors)
            fields = [e.model_dump() for e in errors]
            return problem(422, "ValidationError", detail, field=errors[0].field, errors=fields)
        if example is None:
            return problem(501, "NotImplemented", f"the mock has no example for {op.operation_id}")
        return JSONResponse(response_json(example.response), status_code=example.status)

    return endpoint


def _param_errors(
    params: list[dict[str, Any]],
    checks: dict[str, Draft202012Validator],
    path: Mapping[str, str],
    query: QueryParams,
) -> list[ProblemFieldError]:
    errors = []
    for p in params:
        source = path if p["in"] == "path" else query
        if p["name"] not in source:
            if p.get("required"):
                errors.append(ProblemFieldError(field=p["name"], message="Field required"))
            continue
        schema = p.get("schema", {})
        if p["in"] == "query" and _types(schema) & {"array"}:
            value: Any = [_coerce(v, schema.get("items", {})) for v in query.getlist(p["name"])]
        else:
            value = _coerce(source[p["name"]], schema)
        for e in schema_errors(checks[p["name"]], value):
            errors.append(ProblemFieldError(field=p["name"], message=e.message))
    return errors


async def _body_errors(
    request: Request,
    check: Draft202012Validator,
    model: type[BaseModel] | None,
    required: bool,
) -> list[ProblemFieldError]:
    raw = await request.body()
    if not raw.strip():
        return [ProblemFieldError(field="body", message="Field required")] if required else []
    try:
        body = json.loads(raw)
    except ValueError as err:
        return [ProblemFieldError(field="body", message=f"JSON decode error: {err}")]
    errors = schema_errors(check, body)
    if errors or model is None:
        return errors
    try:
        model.model_validate(body)
    except ValidationError as err:
        return [
            ProblemFieldError(
                field=".".join(str(p) for p in e["loc"]),
                message=str(e["msg"]).removeprefix("Value error, "),
            )
            for e in err.errors(include_url=False)
        ]
    return []


def _types(schema: Mapping[str, Any]) -> set[Any]:
    return {schema.get("type")} | {s.get("type") for s in schema.get("anyOf", [])}


def _coerce(value: str, schema: Mapping[str, Any]) -> Any:
    """A query or path string read as the type its schema asks for, as FastAPI would."""
    types = _types(schema)
    if "boolean" in types and value.lower() in BOOLEANS:
        return BOOLEANS[value.lower()]
    for kind, parse in (("integer", int), ("number", float)):
        if kind in types:
            with contextlib.suppress(ValueError):
                return parse(value)
    return value
