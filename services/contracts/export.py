"""The files in `contracts/`, exported from their one source — the pydantic models of events,
tools and REST bodies, and the gateway's own routes — with the examples of
`services.contracts.examples`; plus the lookups and schema checks the mock and tests share.

    contracts/events/<subject>.schema.json        + <subject>.example.json
    contracts/tools/<name>.input.schema.json      + <name>.output.schema.json, <name>.examples.json
    contracts/tools/error.schema.json             the body of every failed tool call
    contracts/rest/openapi.json                   the gateway's OpenAPI document
    contracts/rest/examples/<operationId>.json    one request and its answer per operation

Output is deterministic (sorted keys, two-space indent), so drift is a plain text comparison.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
from fastapi import FastAPI
from jsonschema import Draft202012Validator
from pydantic import BaseModel

from services.common.messages.events import EVENT_MODELS, Event
from services.contracts.examples import (
    EVENT_EXAMPLES,
    REST_EXAMPLES,
    TOOL_EXAMPLES,
    RestExample,
    ToolExample,
)
from services.gateway.problems import (
    TOOLS_PATH,
    ProblemFieldError,
)
from services.gateway.tools import TOOLS, TOOLSETS, ToolErrorResult, ToolSpec
from services.gateway.tools.registry import schema_errors

__all__ = ["ProblemFieldError", "schema_errors"]

CALL_TOOL = ("POST", TOOLS_PATH + "/{name}")
LIST_TOOLS = ("GET", TOOLS_PATH)
# The tool whose example also stands for `POST /api/v1/tools/{name}` in contracts/rest.
REST_TOOL_EXAMPLE = "kb_search"

OpKey = tuple[str, str]  # (METHOD, path template)


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    operation_id: str
    spec: dict[str, Any]

    @property
    def key(self) -> OpKey:
        return (self.method, self.path)


@dataclass
class Contracts:
    """Everything `contracts/` holds, as objects; `files()` is its exported form."""

    openapi: dict[str, Any]
    operations: dict[OpKey, Operation]
    rest_examples: dict[OpKey, RestExample]
    tools: dict[str, ToolSpec]
    tool_examples: dict[str, list[ToolExample]]
    events: dict[str, type[Event]]
    event_examples: dict[str, Event]
    missing: list[str] = field(default_factory=list)

    @property
    def components(self) -> dict[str, Any]:
        return {"schemas": self.openapi.get("components", {}).get("schemas", {})}

    # ---- JSON forms (what the files hold and what the mock answers) -------------------------

    def tool_example_json(self, name: str, example: ToolExample) -> dict[str, Any]:
        return {
            "input": request_json(example.input),
            # Dumped exactly as `run_tool` dumps a real result.
            "output": example.output.model_dump(mode="json"),
        }

    def rest_example_json(self, example: RestExample) -> dict[str, Any]:
        op = self.operations[(example.method, example.path)]
        request: dict[str, Any] = {"path": example.path_params, "query": example.query}
        if example.body is not None:
            request["body"] = request_json(example.body)
        return {
            "operationId": op.operation_id,
            "method": example.method,
            "path": example.path,
            "request": request,
            "response": {"status": example.status, "body": response_json(example.response)},
        }

    def files(self) -> dict[str, Any]:
        """Relative path → JSON document."""
        out: dict[str, Any] = {}
        for subject, model in self.events.items():
            out[f"events/{subject}.schema.json"] = model.model_json_schema()
            if subject in self.event_examples:
                out[f"events/{subject}.example.json"] = request_json(self.event_examples[subject])
        for name, spec in self.tools.items():
            out[f"tools/{name}.input.schema.json"] = spec.input_schema
            out[f"tools/{name}.output.schema.json"] = spec.output_schema
            if self.tool_examples.get(name):
                out[f"tools/{name}.examples.json"] = [
                    self.tool_example_json(name, ex) for ex in self.tool_examples[name]
                ]
        out["tools/error.schema.json"] = ToolErrorResult.model_json_schema()
        out["rest/openapi.json"] = self.openapi
        for key, example in self.rest_examples.items():
            out[f"rest/examples/{self.operations[key].operation_id}.json"] = self.rest_example_json(
                example
            )
        return out

    # ---- schemas ----------------------------------------------------------------------------

    def response_schema(self, key: OpKey, status: int) -> dict[str, Any]:
        """The schema of `status`'s body for an operation. FastAPI declares one success status
        per route; routes that answer 200 or 202 depending on `wait` share its schema."""
        responses = self.operations[key].spec["responses"]
        entry = responses.get(str(status))
        if entry is None and 200 <= status < 300:
            successes = [v for k, v in responses.items() if k.startswith("2")]
            entry = successes[0] if len(successes) == 1 else None
        if entry is None:
            entry = responses.get("default")
        if entry is None:
            raise KeyError(f"{key[0]} {key[1]} declares no response {status}")
        content = entry.get("content") or {"application/json": {}}
        return next(iter(content.values())).get("schema", {})

    def request_body_schema(self, key: OpKey) -> dict[str, Any] | None:
        body = self.operations[key].spec.get("requestBody")
        if body is None:
            return None
        return body["content"]["application/json"]["schema"]

    def validator(self, schema: dict[str, Any]) -> Draft202012Validator:
        """A validator that resolves the OpenAPI document's `#/components/...` references."""
        return validator({**schema, "components": self.components})


def request_json(model: BaseModel) -> dict[str, Any]:
    """A request as a client writes it: the fields it sets, not the defaults it leaves out."""
    return model.model_dump(mode="json", exclude_unset=True, by_alias=True)


def response_json(body: BaseModel | dict[str, Any]) -> Any:
    """A REST answer as FastAPI serialises a response model."""
    if isinstance(body, BaseModel):
        return body.model_dump(mode="json", by_alias=True)
    return body


def validator(schema: dict[str, Any]) -> Draft202012Validator:
    return Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


# ---- building -------------------------------------------------------------------------------


def schema_only_app() -> FastAPI:
    """The gateway app with every toolset, built only to read its routes and OpenAPI document.
    Its lifespan (which connects to NATS) never runs, so the gateway's parts are stand-ins that
    nothing calls; settings are the defaults, whatever the environment says."""
    from services.common.settings import Settings
    from services.gateway.app import create_app
    from services.gateway.auth import KeyResolver
    from services.gateway.mcp import create_mcp
    from services.gateway.service import GatewayService

    settings = Settings.model_construct(mcp_toolsets=",".join(TOOLSETS))
    service = GatewayService(
        bus=None,  # type: ignore[arg-type]
        registries=SimpleNamespace(keys=None),  # type: ignore[arg-type]
        settings=settings,
    )
    keys = KeyResolver(None, settings.default_org)  # type: ignore[arg-type]
    return create_app(service, keys, mcp=create_mcp(service, keys=keys))


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document (its error answers as they are on the wire:
    services/gateway/problems.py)."""
    return copy.deepcopy(app.openapi())


def _operations(doc: dict[str, Any]) -> dict[OpKey, Operation]:
    ops = {}
    for path, methods in doc.get("paths", {}).items():
        for method, spec in methods.items():
            op = Operation(method.upper(), path, spec["operationId"], spec)
            ops[op.key] = op
    return ops


def _answer_of(app: FastAPI, path: str) -> Any:
    """What the app answers to `GET path` (a route that needs no runtime)."""

    async def get() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            response = await client.get(path)
            response.raise_for_status()
            return response.json()

    # In a thread of its own: callers (tests, the mock) may already run an event loop.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, get()).result()


@functools.cache
def build() -> Contracts:
    """The contracts of the code as it is now (TOOLS and routes as registered at call time)."""
    app = schema_only_app()
    doc = openapi_document(app)
    operations = _operations(doc)
    rest = {(ex.method, ex.path): ex for ex in REST_EXAMPLES}
    if LIST_TOOLS in operations:
        rest[LIST_TOOLS] = RestExample(*LIST_TOOLS, 200, _answer_of(app, TOOLS_PATH))
    tool_example = TOOL_EXAMPLES.get(REST_TOOL_EXAMPLE)
    if CALL_TOOL in operations and tool_example:
        rest[CALL_TOOL] = RestExample(
            *CALL_TOOL,
            200,
            tool_example[0].output.model_dump(mode="json"),
            path_params={"name": REST_TOOL_EXAMPLE},
            body=tool_example[0].input,
        )
    missing = [f"REST {m} {p}: no example" for (m, p) in operations if (m, p) not in rest]
    missing += [
        f"REST {m} {p}: example of no operation" for (m, p) in rest if (m, p) not in operations
    ]
    missing += [f"tool {n}: no example" for n in TOOLS if not TOOL_EXAMPLES.get(n)]
    missing += [f"tool {n}: example of no tool" for n in TOOL_EXAMPLES if n not in TOOLS]
    missing += [f"event {s}: no example" for s in EVENT_MODELS if s not in EVENT_EXAMPLES]
    missing += [f"event {s}: example of no event" for s in EVENT_EXAMPLES if s not in EVENT_MODELS]
    return Contracts(
        openapi=doc,
        operations=operations,
        rest_examples={k: v for k, v in rest.items() if k in operations},
        tools=dict(sorted(TOOLS.items())),
        tool_examples={n: TOOL_EXAMPLES.get(n, []) for n in sorted(TOOLS)},
        events={str(s): m for s, m in EVENT_MODELS.items()},
        event_examples={str(s): e for s, e in EVENT_EXAMPLES.items() if s in EVENT_MODELS},
        missing=missing,
    )


# ---- files ----------------------------------------------------------------------------------

MANAGED = ("events", "tools", "rest")


def render(document: Any) -> str:
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _existing(root: Path) -> Iterable[str]:
    for part in MANAGED:
        base = root / part
        if base.is_dir():
            yield from (p.relative_to(root).as_posix() for p in base.rglob("*") if p.is_file())


def drift(root: Path, contracts: Contracts | None = None) -> list[str]:
    """What differs between `root` and the code: `changed|missing|stale <relative path>`."""
    wanted = {path: render(doc) for path, doc in (contracts or build()).files().items()}
    out = []
    for path, text in sorted(wanted.items()):
        target = root / path
        if not target.exists():
            out.append(f"missing {path}")
        elif target.read_text(encoding="utf-8") != text:
            out.append(f"changed {path}")
    out += [f"stale {p}" for p in sorted(_existing(root)) if p not in wanted]
    return out


def export(root: Path, contracts: Contracts | None = None) -> list[str]:
    """Write the contracts under `root` and remove files no contract produces any more.
    Returns what changed, in `drift`'s terms."""
    contracts = contracts or build()
    changes = drift(root, contracts)
    wanted = contracts.files()
    for change in changes:
        kind, path = change.split(" ", 1)
        target = root / path
        if kind == "stale":
            target.unlink()
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(render(wanted[path]), encoding="utf-8")
    return changes
