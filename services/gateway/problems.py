"""How the REST API fails, in one place: the problem-details body (RFC 9457) every /v1 error
answers with, the `Retry-After` of every 503 (NATS away, no search service), and the OpenAPI
document's account of both — every status an operation can answer, with its media type."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from services.common.bus.client import unavailable
from services.common.domain.errors import KbmeshError
from services.gateway.schemas import ProblemFieldError
from services.gateway.tools import ToolErrorResult

__all__ = ["ProblemFieldError"]

PROBLEM_MEDIA_TYPE = "application/problem+json"
TOOLS_PATH = "/api/v1/tools"
# Paths whose failures are problem details or tool errors (health checks answer their own).
API_PREFIXES = ("/v1/", TOOLS_PATH)
# NATS restarts in about a second, a cluster elects a new leader in a few.
RETRY_AFTER_SECONDS = 2
RETRY_AFTER = {"Retry-After": str(RETRY_AFTER_SECONDS)}


class Problem(BaseModel):
    """Every failed REST call (outside /api/v1/tools): RFC 9457 problem details, served as
    `application/problem+json`."""

    type: str = Field(description="urn:kbmesh:error:<error_type>")
    title: str
    status: int
    detail: str = Field(description="what went wrong, for a person or an LLM to act on")
    error_type: str = Field(
        description="ValidationError, ContentTooLarge, NotFound, Forbidden, Unauthorized, "
        "Conflict, Unavailable, InternalError"
    )
    field: str | None = Field(
        None,
        description="the input field at fault, when known (for a ValidationError: the first "
        "of `errors`)",
    )
    errors: list[ProblemFieldError] | None = Field(
        None, description="every invalid field (ValidationError only)"
    )


_ERROR_TYPES = {
    400: "ValidationError",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    413: "ContentTooLarge",
    415: "UnsupportedMediaType",
    421: "MisdirectedRequest",
    422: "ValidationError",
    503: "Unavailable",
}


def http_error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "HTTPError")


def problem(status: int, error_type: str, message: str, **extra: Any) -> JSONResponse:
    body = {
        "type": f"urn:kbmesh:error:{error_type}",
        "title": error_type,
        "status": status,
        "detail": message,
        "error_type": error_type,
        **extra,
    }
    headers = RETRY_AFTER if status == 503 else None
    return JSONResponse(body, status_code=status, media_type=PROBLEM_MEDIA_TYPE, headers=headers)


def error_problem(err: KbmeshError) -> JSONResponse:
    extra = {"field": err.field} if err.field else {}
    return problem(err.status_code, err.error_type, err.message, **extra)


def bus_problem(err: Exception) -> JSONResponse:
    # NATS restarting, unreachable, or a cluster without JetStream quorum: any call may
    # time out; the client should retry, not see a server error.
    transient = unavailable(err)
    return problem(transient.status_code, transient.error_type, transient.message)


# ---- the OpenAPI document ----------------------------------------------------------------------

_DESCRIPTIONS = {
    400: "The body is not valid JSON",
    401: "No API key, or an unknown one",
    403: "The API key may not do this (read-only, or limited to other knowledge bases), or "
    "a web page of another origin sent the write",
    404: "No such resource in the caller's org and scope",
    409: "Conflicts with the current state (a limit, a duplicate name, a concurrent change)",
    413: "The body, or a document's content, is larger than its limit",
    415: "The body is not `application/json`",
    422: "The request is invalid; `errors` lists every field at fault",
    503: "NATS or a service is unavailable; retry after `Retry-After` seconds",
}
_WRITES = {"post", "put", "patch", "delete"}
_BODIES = {"post", "put", "patch"}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before retrying",
        "schema": {"type": "integer"},
    }
}


def error_statuses(method: str) -> list[int]:
    statuses = [401, 403, 404, 422, 503]
    if method in _WRITES:
        statuses.append(409)
    if method in _BODIES:
        statuses += [400, 413, 415]
    return sorted(statuses)


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document with the error answers as they are on the wire: FastAPI documents
    a `{detail: [...]}` 422 as `application/json`, but the gateway answers every failure of
    /v1 with a `Problem` (`application/problem+json`) and every failure of /api/v1/tools with
    a `ToolErrorResult`; 503s carry `Retry-After`."""
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
        tags=app.openapi_tags,
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema(
        [(Problem, "validation"), (ToolErrorResult, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    for name, schema in defs["$defs"].items():
        if schemas.get(name, schema) != schema:
            raise RuntimeError(f"OpenAPI component {name!r} exists with another schema")
        schemas[name] = schema
    for path, ops in doc.get("paths", {}).items():
        if not path.startswith(API_PREFIXES):
            continue
        tools = path.startswith(TOOLS_PATH)
        media = "application/json" if tools else PROBLEM_MEDIA_TYPE
        model = ToolErrorResult if tools else Problem
        for method, op in ops.items():
            responses = op["responses"]
            responses.pop("422", None)
            for status in error_statuses(method):
                answer: dict[str, Any] = {
                    "description": _DESCRIPTIONS[status],
                    "content": {
                        media: {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
                    },
                }
                if status == 503:
                    answer["headers"] = _RETRY_AFTER
                responses[str(status)] = answer
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, referrer first
        if f'"#/components/schemas/{unused}"' not in json.dumps(doc):
            schemas.pop(unused, None)
    return doc
