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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import cached_property
from types import UnionType
from typing import Any, Literal, Self, Union, get_args, get_origin, get_type_hints

import jsonschema_rs
from jsonschema import Draft202012Validator
from pydantic import BaseModel, Field, PrivateAttr, ValidationError
from pydantic.alias_generators import to_camel

from services.common.bus.client import BUS_UNAVAILABLE, unavailable
from services.common.domain.errors import InvalidInput, KbmeshError
from services.gateway.auth import Principal
from services.gateway.schemas import ProblemFieldError
from services.gateway.service import GatewayService
from services.gateway.service.resources import ResourceInfo

log = logging.getLogger("kbmesh.tools")

TOOLSETS = ("core", "compat")


ToolFn = Callable[[GatewayService, Principal, Any], Awaitable[BaseModel]]
# The documents a tool's result cites, as links a client can open (MCP `resource_link`).
Cites = Callable[[Any], Sequence[ResourceInfo]]


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
    cites: Cites | None = None
    read_only: bool = False
    destructive: bool = False
    open_world: bool = False
    # The service's names for fields the tool calls otherwise (e.g. kb_id → projectId), so
    # an error names the parameter the caller sent.
    error_fields: Mapping[str, str] = dataclass_field(default_factory=dict)

    @cached_property
    def input_schema(self) -> dict[str, Any]:
        return self.input_model.model_json_schema()

    @cached_property
    def input_check(self) -> Draft202012Validator:
        return Draft202012Validator(self.input_schema)

    @cached_property
    def input_fast_check(self) -> Any:
        """A yes/no answer in microseconds (jsonschema-rs); `input_check` words the errors,
        about a millisecond a call."""
        return jsonschema_rs.validator_for(self.input_schema, validate_formats=False)

    def caller_field(self, field: str | None) -> str | None:
        """The parameter (path) the caller sent that a service error's `field` concerns, or
        None when the error concerns none of them."""
        if not field:
            return None
        head, dot, rest = field.partition(".")
        params = self.input_model.model_fields
        if head in params:
            return field
        for name in (field, head):
            if name in self.error_fields:
                mapped = self.error_fields[name]
                return mapped + (dot + rest if name == head and rest else "")
        camel = to_camel(head)
        return camel + dot + rest if camel in params else None

    @cached_property
    def output_schema(self) -> dict[str, Any]:
        return self.output_model.model_json_schema()


TOOLS: dict[str, ToolSpec] = {}


def tool(
    *toolsets: str,
    title: str,
    render: Callable[[Any], str] | None = None,
    cites: Cites | None = None,
    read_only: bool = False,
    destructive: bool = False,
    open_world: bool = False,
    error_fields: Mapping[str, str] | None = None,
) -> Callable[[ToolFn], ToolFn]:
    """Register `fn(service, principal, input) -> output` under its own name; the input and
    output models are read from its annotations and the description from its docstring.
    `render` writes the output's text, `cites` lists the documents it cites."""

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
            cites=cites,
            read_only=read_only,
            destructive=destructive,
            open_world=open_world,
            error_fields=error_fields or {},
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


class CitingOutput(BaseModel):
    """An output whose contract names no document ids (a compat shape) but whose tool links
    the documents it cites: the links ride along outside its schema and its JSON."""

    _cited: list[ResourceInfo] = PrivateAttr(default_factory=list)

    def citing(self, links: Sequence[ResourceInfo]) -> Self:
        self._cited = list(links)
        return self

    def cited(self) -> list[ResourceInfo]:
        return self._cited


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
    """A tool call's answer. A result has `structured` content (matching the output schema),
    its text and links to the documents it cites; a failure has only text and `error` — MCP
    clients validate structured content against the output schema even on errors, so an
    error must not carry any."""

    text: str
    structured: dict[str, Any] | None = None
    links: tuple[ResourceInfo, ...] = ()
    error: ToolErrorResult | None = None
    status_code: int = 200

    @property
    def is_error(self) -> bool:
        return self.error is not None

    @property
    def body(self) -> dict[str, Any]:
        """The JSON answer of `POST /api/v1/tools/<name>`: the result, or the error."""
        if self.error is not None:
            return self.error.model_dump(exclude_none=True)
        return self.structured or {}


async def run_tool(
    spec: ToolSpec, service: GatewayService, principal: Principal, arguments: Mapping[str, Any]
) -> ToolOutcome:
    """Validate, run, and map the result or error: the one path both transports take.

    Arguments are held to the published input schema first, without type coercion (so a
    client that satisfies the schema satisfies the server, and `"5"` is not an integer),
    then to the input model's own checks."""
    arguments = _json_strings(spec.input_model, arguments)
    valid = spec.input_fast_check.is_valid(arguments)
    refused = [] if valid else schema_errors(spec.input_check, arguments)
    if refused:
        return error_outcome(invalid_arguments(refused))
    try:
        inp = spec.input_model.model_validate(arguments)
        output = await spec.fn(service, principal, inp)
    except ValidationError as err:
        return error_outcome(_invalid(err))
    except KbmeshError as err:
        return error_outcome(err, spec.caller_field(err.field))
    except BUS_UNAVAILABLE as err:
        return error_outcome(unavailable(err))
    except Exception:
        # Recorded here with its traceback; the caller sees only that it happened.
        log.exception("tool_failed tool=%s org_id=%s", spec.name, principal.org_id)
        return error_outcome(
            KbmeshError(f"internal error while running {spec.name}; the server log has the details")
        )
    structured = output.model_dump(mode="json")
    text = (
        spec.render(output) if spec.render else json.dumps(structured, indent=2, ensure_ascii=False)
    )
    links = tuple(spec.cites(output)) if spec.cites else ()
    return ToolOutcome(text=text, structured=structured, links=links)


def error_outcome(err: KbmeshError, field: str | None = None) -> ToolOutcome:
    """`err` as a tool error; `field` (default: the error's own) names the parameter."""
    field = field if field is not None else err.field
    result = ToolErrorResult(error_type=err.error_type, message=err.message, field=field)
    where = f" (field {field})" if field else ""
    return ToolOutcome(
        text=f"Error ({err.error_type}){where}: {err.message}",
        error=result,
        status_code=err.status_code,
    )


def schema_errors(check: Draft202012Validator, instance: Any) -> list[ProblemFieldError]:
    """Every violation of a JSON Schema, in a stable order, named by the field path it
    concerns."""
    found = []
    for err in check.iter_errors(instance):
        path = [str(p) for p in err.absolute_path]
        if err.validator == "oneOf" and not path:
            # A rule across fields (exactly one of content, url, path): the input model
            # checks it next and says which, in words.
            continue
        message = err.message
        if err.validator in ("anyOf", "oneOf") and err.context:
            # "42 is not of type 'string'" rather than "not valid under any given schema".
            message = err.context[0].message
        if err.validator == "required" and isinstance(err.instance, dict):
            missing = [k for k in err.validator_value if k not in err.instance]
            path += missing[:1]
        elif err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = set(err.schema.get("properties", {}))
            path += sorted(k for k in err.instance if k not in allowed)[:1]
        if err.validator == "required" and path and "then" in err.absolute_schema_path:
            message = f"{path[-1]} is required {_condition(check.schema, err)}"
        found.append(ProblemFieldError(field=".".join(path), message=_message(message)))
    return sorted(found, key=lambda e: (e.field, e.message))


def _condition(schema: dict[str, Any], err: Any) -> str:
    """The `if` of the if/then rule an error broke, in words: "when operation is 'search'"."""
    node: Any = schema
    steps = list(err.absolute_schema_path)
    for step in steps[: steps.index("then")]:
        node = node[step]
    consts = {k: v["const"] for k, v in node.get("if", {}).get("properties", {}).items()}
    return "when " + " and ".join(f"{k} is {v!r}" for k, v in consts.items())


def _message(message: str) -> str:
    # jsonschema quotes whole sub-schemas in some messages (oneOf, not): keep them readable.
    return message if len(message) <= 300 else message[:297] + "..."


def invalid_arguments(errors: list[ProblemFieldError]) -> InvalidInput:
    detail = "; ".join(f"{e.field}: {e.message}" if e.field else e.message for e in errors)
    return InvalidInput(f"invalid arguments: {detail}", field=errors[0].field or None)


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
