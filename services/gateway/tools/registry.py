"""The tool registry: each tool's contract (input and output models) and function, and
`run_tool`, the one path MCP (`mcp.py`) and REST (`api/tools.py`) both take, so the two
surfaces answer with the same JSON. These models are the single source of the tool contracts
(`TOOLS` is the registry the contract export reads).

Toolsets: `core` — kbmesh's own knowledge-base lifecycle; `compat` — the names, parameters and
result shapes that existing knowledge-base clients already call. A tool may be in both.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, Field, ValidationError

from services.common.bus import BUS_UNAVAILABLE, unavailable
from services.common.errors import InvalidInput, KbmeshError
from services.gateway.auth import Principal
from services.gateway.service import GatewayService

log = logging.getLogger("kbmesh.tools")

TOOLSETS = ("core", "compat")


ToolFn = Callable[[GatewayService, Principal, Any], Awaitable[BaseModel]]


@dataclass(frozen=True)
class ToolSpec:
    """One tool: its contract (input and output models) and the function that runs it."""

    name: str
    toolsets: tuple[str, ...]
    title: str
    description: str
    input_model: type[BaseModel]
    output_model: type[BaseModel]
    fn: ToolFn
    render: Callable[[Any], str] | None = None
    read_only: bool = False
    destructive: bool = False
    open_world: bool = False
    # manageKnowledge answers several operations with one model: unused fields stay out.
    exclude_none: bool = False

    @cached_property
    def input_schema(self) -> dict[str, Any]:
        return self.input_model.model_json_schema()

    @cached_property
    def output_schema(self) -> dict[str, Any]:
        return self.output_model.model_json_schema()


TOOLS: dict[str, ToolSpec] = {}


def tool(
    *toolsets: str,
    title: str,
    render: Callable[[Any], str] | None = None,
    read_only: bool = False,
    destructive: bool = False,
    open_world: bool = False,
    exclude_none: bool = False,
) -> Callable[[ToolFn], ToolFn]:
    """Register `fn(service, principal, input) -> output` under its own name; the input and
    output models are read from its annotations and the description from its docstring."""

    def register(fn: ToolFn) -> ToolFn:
        hints = get_type_hints(fn)
        TOOLS[fn.__name__] = ToolSpec(
            name=fn.__name__,
            toolsets=toolsets,
            title=title,
            # One paragraph per blank-line block: clients show descriptions reflowed.
            description=re.sub(r"(?<!\n)\n(?!\n)", " ", inspect.cleandoc(fn.__doc__ or "")),
            input_model=hints["inp"],
            output_model=hints["return"],
            fn=fn,
            render=render,
            read_only=read_only,
            destructive=destructive,
            open_world=open_world,
            exclude_none=exclude_none,
        )
        return fn

    return register


def tools_for(toolsets: list[str] | tuple[str, ...]) -> dict[str, ToolSpec]:
    unknown = [t for t in toolsets if t not in TOOLSETS]
    if unknown:
        raise ValueError(
            f"KBMESH_MCP_TOOLSETS: unknown toolset(s) {', '.join(unknown)}; "
            f"choose from {', '.join(TOOLSETS)}"
        )
    return {n: s for n, s in TOOLS.items() if set(s.toolsets) & set(toolsets)}


class ToolErrorResult(BaseModel):
    """What every tool returns on failure (flagged `isError` in MCP; a 4xx/5xx in REST)."""

    status: Literal["error"] = "error"
    error_type: str = Field(
        description="ValidationError, ContentTooLarge, NotFound, "
        "Forbidden, Unauthorized, Conflict, FetchError, Unavailable, ..."
    )
    message: str
    field: str | None = Field(None, description="the input field at fault, when known")


@dataclass(frozen=True)
class ToolOutcome:
    structured: dict[str, Any]
    text: str
    error: KbmeshError | None = None

    @property
    def is_error(self) -> bool:
        return self.error is not None

    @property
    def status_code(self) -> int:
        return self.error.status_code if self.error is not None else 200


async def run_tool(
    spec: ToolSpec, service: GatewayService, principal: Principal, arguments: Mapping[str, Any]
) -> ToolOutcome:
    """Validate, run, and map the result or error: the one path both transports take."""
    try:
        inp = spec.input_model.model_validate(_json_strings(spec.input_model, arguments))
        output = await spec.fn(service, principal, inp)
    except ValidationError as err:
        return error_outcome(_invalid(err))
    except KbmeshError as err:
        return error_outcome(err)
    except BUS_UNAVAILABLE as err:
        return error_outcome(unavailable(err))
    except Exception:
        # Recorded here with its traceback; the caller sees only that it happened.
        log.exception("tool_failed tool=%s org_id=%s", spec.name, principal.org_id)
        return error_outcome(
            KbmeshError(f"internal error while running {spec.name}; the server log has the details")
        )
    structured = output.model_dump(mode="json", exclude_none=spec.exclude_none)
    text = (
        spec.render(output) if spec.render else json.dumps(structured, indent=2, ensure_ascii=False)
    )
    return ToolOutcome(structured=structured, text=text)


def error_outcome(err: KbmeshError) -> ToolOutcome:
    result = ToolErrorResult(error_type=err.error_type, message=err.message, field=err.field)
    return ToolOutcome(
        structured=result.model_dump(exclude_none=True),
        text=f"Error ({err.error_type}): {err.message}",
        error=err,
    )


def _invalid(err: ValidationError) -> InvalidInput:
    parts, first_field = [], None
    for e in err.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"])
        first_field = first_field or loc or None
        msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return InvalidInput("invalid arguments: " + "; ".join(parts), field=first_field)


def _json_strings(model: type[BaseModel], arguments: Mapping[str, Any]) -> dict[str, Any]:
    """Some clients send lists and objects as JSON text; decode those for non-string fields."""
    out = dict(arguments or {})
    for name, value in out.items():
        field = model.model_fields.get(name)
        if field is None or _accepts_str(field.annotation) or not isinstance(value, str):
            continue
        if value.lstrip()[:1] in ("[", "{"):
            with contextlib.suppress(ValueError):
                out[name] = json.loads(value)
    return out


def _accepts_str(annotation: Any) -> bool:
    if annotation is str:
        return True
    if get_origin(annotation) in (Union, UnionType, Literal):
        return any(_accepts_str(a) or isinstance(a, str) for a in get_args(annotation))
    return False
