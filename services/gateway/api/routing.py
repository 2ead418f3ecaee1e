"""The REST routes' class: a JSON body is held to its model's published JSON Schema before
FastAPI validates it, without type coercion, exactly as the tools hold their arguments
(`tools.registry.run_tool`). Pydantic alone would take `"5"` or `true` for an integer; the
schema a client reads says neither is one, and REST and the tools must refuse the same
bodies.

A route whose endpoint `files.accepts_files` marks takes a file body too: a request whose body
is not JSON goes to the marked endpoint, through FastAPI's own handling of its parameters,
with the body unread."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Coroutine
from functools import cache
from typing import Any, get_args

import jsonschema_rs
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.utils import deep_dict_update
from jsonschema import Draft202012Validator
from pydantic import BaseModel, ValidationError

from services.gateway.api.files import file_bodies_openapi, files_endpoint, is_json
from services.gateway.tools.registry import schema_errors


@cache
def _schema_checks(model: type[BaseModel]) -> tuple[Any, Draft202012Validator]:
    """A fast yes/no check (jsonschema-rs: microseconds, where the Python validator takes
    about a millisecond for a search) and the validator that words the errors."""
    schema = model.model_json_schema()
    return (
        jsonschema_rs.validator_for(schema, validate_formats=False),
        Draft202012Validator(schema),
    )


def _body_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a body annotated `Model` or `Model | None`."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _model_accepts(model: type[BaseModel], body: Any) -> bool:
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    return True


class StrictBodyRoute(APIRoute):
    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if files_endpoint(endpoint) is not None:
            extra = copy.deepcopy(file_bodies_openapi())
            deep_dict_update(extra, kwargs.get("openapi_extra") or {})
            kwargs["openapi_extra"] = extra
        super().__init__(path, endpoint, **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = self._json_handler()
        files = files_endpoint(self.endpoint)
        if files is None:
            return handler
        file_handler = APIRoute(
            self.path,
            files,
            status_code=self.status_code,
            dependencies=self.dependencies,
            dependency_overrides_provider=self.dependency_overrides_provider,
        ).get_route_handler()

        async def either(request: Request) -> Response:
            if is_json(request.headers.get("content-type")):
                return await handler(request)
            return await file_handler(request)

        return either

    def _json_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = _body_model(self.body_field.field_info.annotation if self.body_field else None)
        if model is None:
            return handler
        fast, check = _schema_checks(model)

        async def strict_handler(request: Request) -> Response:
            raw = await request.body()  # kept by the request: the handler reads it again
            try:
                body = json.loads(raw) if raw.strip() else None
            except ValueError:
                body = None  # not JSON: FastAPI's own parsing says so
            valid = body is None or fast.is_valid(body)
            errors = [] if valid else schema_errors(check, body)
            # What the model refuses too is refused by the handler, in the model's words (its
            # field paths reach inside unions, the schema's stop at them); what only the
            # schema refuses is what the model would have coerced.
            if errors and _model_accepts(model, body):
                raise RequestValidationError(
                    [
                        {
                            "loc": ("body", *(e.field.split(".") if e.field else ())),
                            "msg": e.message,
                            "type": "json_schema",
                        }
                        for e in errors
                    ]
                )
            return await handler(request)

        return strict_handler
