"""REST file uploads: the document routes take a file as a multipart form (the file in the
field `file`, the upload's fields beside it) or as the raw body with its own Content-Type
(the fields as query parameters), besides a JSON body. The file streams into an `Incoming`
(counted against the size limit, held once) and reaches the service as bytes: no base64.

The form is read with python-multipart's streaming parser, the one Starlette drives:
Starlette's own form reading keeps every file whole, however large, before a route sees it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from functools import cache
from typing import Any, TypeVar, get_origin

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from services.common.domain.content import SUPPORTED, declared_mime, is_supported, too_large
from services.common.domain.errors import InvalidInput
from services.common.domain.formats import clean_mime
from services.gateway.auth import Principal
from services.gateway.schemas import FileFields, UploadResult
from services.gateway.service.documents import Content, Documents
from services.gateway.service.incoming import Incoming

FILE = "file"
FORM = "multipart/form-data"
URLENCODED = "application/x-www-form-urlencoded"
# A form's fields besides the file, all together: far above what they may hold (metadata is
# 64 KiB by default), far below what would cost the gateway memory.
FIELD_BYTES = 1024 * 1024
MAX_PARTS = 1000
# Query parameters that are the route's own, not the upload's fields.
ROUTE_PARAMETERS = frozenset({"wait"})


def is_json(content_type: str | None) -> bool:
    """Whether a body of this type is JSON (FastAPI reads a body without a type as JSON)."""
    media = clean_mime(content_type)
    return not media or media == "application/json" or media.endswith("+json")


async def receive_file(
    request: Request, documents: Documents, p: Principal, kb_ref: str | None, *, wait: bool
) -> UploadResult:
    """Upload the file that `request` carries, as a form or as its raw body, into `kb_ref`
    (None: the KB the fields name, if any). Who may write, and where, is checked before a
    byte of the body is read wherever the request says it up front."""
    media = clean_mime(request.headers.get("content-type"))
    if media == URLENCODED:
        raise HTTPException(
            415,
            "a urlencoded form cannot carry a file: send it as multipart/form-data (curl -F "
            "file=@report.pdf) or as the raw body with its own Content-Type",
        )
    try:
        if media == FORM:
            return await _receive_form(request, documents, p, kb_ref, wait=wait)
        return await _receive_raw(request, media, documents, p, kb_ref, wait=wait)
    except ClientDisconnect as err:
        # Answered to nobody, but not logged as a server error: the client went away.
        raise InvalidInput("the upload was cut off before its end", field="body") from err


async def _receive_form(
    request: Request, documents: Documents, p: Principal, kb_ref: str | None, *, wait: bool
) -> UploadResult:
    # The fields (a `kb_id` among them) may follow the file: only the route's KB, or that
    # the key may write at all, is known before the body is read.
    if kb_ref:
        await documents.target(p, kb_ref)
    else:
        p.check_write()
    with Incoming(documents.settings.max_content_bytes, field=FILE) as incoming:
        values, name, part_type = await _read_form(request, incoming)
        fields = _fields(values, "body")
        content = Content(incoming, name, part_type, field=FILE)
        return await documents.upload_content(p, fields, content, kb_ref, wait=wait)


async def _receive_raw(
    request: Request,
    media: str,
    documents: Documents,
    p: Principal,
    kb_ref: str | None,
    *,
    wait: bool,
) -> UploadResult:
    fields = _fields(_query(request), "query")
    declared = declared_mime(media)
    if declared is not None and not is_supported(declared):
        raise HTTPException(
            415,
            f"kbmesh does not read {declared!r} (the body's Content-Type); send one of "
            f"{', '.join(SUPPORTED)}, or application/octet-stream to let the server read "
            "the type from the bytes and the name",
        )
    if not fields.name:
        raise InvalidInput(
            "name is required with a raw body: give it as a query parameter (?name=report.pdf)",
            field="name",
        )
    await documents.target(p, kb_ref or fields.kb_id)
    limit = documents.settings.max_content_bytes
    length = request.headers.get("content-length", "").strip()
    if length.isdigit() and int(length) > limit:
        raise too_large(limit, int(length))  # refused before a byte of it is read
    with Incoming(limit) as incoming:
        async for chunk in request.stream():
            await incoming.write(chunk)
        content = Content(incoming, mime_type=declared)
        return await documents.upload_content(p, fields, content, kb_ref, wait=wait)


def _query(request: Request) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for key, value in request.query_params.multi_items():
        if key not in ROUTE_PARAMETERS:
            values.setdefault(key, []).append(value)
    return values


def _fields(values: Mapping[str, list[str]], where: str) -> FileFields:
    """The upload's fields from a form or a query: `tags` as every value given, `metadata`
    parsed as a JSON object, every other field once. Errors come as FastAPI's own (422)."""
    data: dict[str, Any] = {}
    errors: list[dict[str, Any]] = []

    def invalid(key: str, message: str) -> None:
        errors.append({"loc": (where, key), "msg": message, "type": "value_error"})

    for key, given in values.items():
        info = FileFields.model_fields.get(key)
        annotation = info.annotation if info is not None else None
        if get_origin(annotation) is list:
            data[key] = given
        elif len(given) > 1:
            invalid(key, "given more than once")
        elif key == "metadata":
            try:
                metadata = json.loads(given[0])
            except ValueError:
                metadata = None
            if not isinstance(metadata, dict):
                invalid(key, "must be a JSON object")
            data[key] = metadata
        else:
            data[key] = given[0]
    if not errors:
        try:
            return FileFields.model_validate(data)
        except ValidationError as err:
            errors = [
                {"loc": (where, *e["loc"]), "msg": e["msg"], "type": e["type"]}
                for e in err.errors(include_url=False)
            ]
    raise RequestValidationError(errors)


class _Form:
    """python-multipart's callbacks: the fields' values, and the one file part's bytes in
    the order they arrive (taken after each write, to go into the `Incoming`)."""

    def __init__(self) -> None:
        self.values: dict[str, list[str]] = {}
        self.file_seen = False
        self.complete = False  # the closing boundary was read
        self.filename: str | None = None
        self.part_type: str | None = None
        self.pending: list[bytes] = []
        self._field_bytes = 0
        self._parts = 0
        self._headers: dict[bytes, bytes] = {}
        self._header = b""
        self._value = b""
        self._name = ""
        self._in_file = False
        self._data = bytearray()

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self._begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def take(self) -> list[bytes]:
        taken, self.pending = self.pending, []
        return taken

    def _begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise InvalidInput(f"the form has more than {MAX_PARTS} parts", field="body")
        self._headers, self._data, self._in_file = {}, bytearray(), False

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header.lower()] = self._value
        self._header, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition"))
        if b"name" not in options:
            raise InvalidInput("a form part has no name (Content-Disposition)", field="body")
        self._name = _text(options[b"name"])
        if b"filename" not in options:
            return
        if self._name != FILE or self.file_seen:
            raise InvalidInput(
                f"a form carries one file, in the field {FILE!r}", field=self._name or "body"
            )
        self.file_seen = self._in_file = True
        # Only the base name: some clients send the path the file had on their disk.
        self.filename = _text(options[b"filename"]).replace("\\", "/").rsplit("/", 1)[-1] or None
        part_type = declared_mime(_text(self._headers.get(b"content-type", b"")))
        # The part's type is what the client's own table said (browsers guess by extension):
        # a hint when it is a type kbmesh reads, nothing otherwise (ingest reads the bytes).
        self.part_type = part_type if part_type and is_supported(part_type) else None

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self.pending.append(bytes(data[start:end]))
            return
        self._field_bytes += end - start
        if self._field_bytes > FIELD_BYTES:
            raise InvalidInput(
                f"the form's fields hold more than {FIELD_BYTES} bytes", field=self._name
            )
        self._data += data[start:end]

    def _part_end(self) -> None:
        if not self._in_file:
            self.values.setdefault(self._name, []).append(_text(bytes(self._data), strict=True))

    def _end(self) -> None:
        self.complete = True


def _text(raw: bytes, *, strict: bool = False) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if strict:
            raise InvalidInput("a form field is not UTF-8 text", field="body") from err
        return raw.decode("latin-1")  # a header in another charset: kept readable


async def _read_form(
    request: Request, incoming: Incoming
) -> tuple[dict[str, list[str]], str | None, str | None]:
    """The form's fields, the file's name and declared type; its bytes go into `incoming`
    as they arrive."""
    _, options = parse_options_header(request.headers.get("content-type"))
    boundary = options.get(b"boundary")
    if not boundary:
        raise InvalidInput("a multipart/form-data body needs a boundary", field="body")
    form = _Form()
    try:
        parser = MultipartParser(boundary, form.callbacks())  # type: ignore[arg-type]
        async for chunk in request.stream():
            parser.write(chunk)
            for data in form.take():
                await incoming.write(data)
        parser.finalize()
    except FormParserError as err:
        raise InvalidInput(f"the multipart body is malformed: {err}", field="body") from err
    if not form.complete:
        # python-multipart's finalize() does not check this: a body cut short (or one that
        # never closes its parts) would pass for a whole file.
        raise InvalidInput("the multipart body ends before its closing boundary", field="body")
    if not form.file_seen:
        raise InvalidInput(
            f"a multipart upload carries the document in the field {FILE!r}", field=FILE
        )
    return form.values, form.filename, form.part_type


# ---- routes ---------------------------------------------------------------------------------

FILES_ENDPOINT = "kbmesh_files"
E = TypeVar("E", bound=Callable[..., Any])


def accepts_files(files: Callable[..., Awaitable[Any]]) -> Callable[[E], E]:
    """Mark a JSON upload endpoint as taking a file body too: a request whose body is not
    JSON goes to `files` instead (same path, query and dependencies, resolved by FastAPI),
    its body unread for `files` to stream. See `routing.StrictBodyRoute`."""

    def mark(endpoint: E) -> E:
        setattr(endpoint, FILES_ENDPOINT, files)
        return endpoint

    return mark


def files_endpoint(endpoint: Callable[..., Any]) -> Callable[..., Awaitable[Any]] | None:
    found = getattr(endpoint, FILES_ENDPOINT, None)
    return found if callable(found) else None


def takes_files(route: BaseRoute) -> bool:
    return isinstance(route, APIRoute) and files_endpoint(route.endpoint) is not None


def takes_file_bodies(routes: Iterable[BaseRoute], scope: Scope) -> bool:
    """Whether the request `scope` goes to one of `routes` that takes file bodies."""
    return any(takes_files(r) and r.matches(scope)[0] == Match.FULL for r in routes)


@cache
def file_bodies_openapi() -> dict[str, Any]:
    """The OpenAPI account of a route's file bodies, merged into its JSON one: the form,
    the raw body, and the query parameters that carry a raw body's fields."""
    fields = FileFields.model_json_schema()["properties"]
    metadata = {
        "type": "string",
        "description": f"{fields['metadata']['description']}, as a JSON object",
    }
    form = {
        FILE: {
            "type": "string",
            "format": "binary",
            "description": "the document's bytes; its file name is the document's name unless "
            "`name` says otherwise",
        },
        **fields,
        "metadata": metadata,
    }
    parameters = [
        {
            "name": name,
            "in": "query",
            "required": False,
            "schema": metadata if name == "metadata" else schema,
            "description": f"with a raw body: {schema.get('description', name)}"
            + (" (required)" if name == "name" else ""),
        }
        for name, schema in fields.items()
    ]
    return {
        "requestBody": {
            "description": "The document as a JSON body (text, or base64), as a "
            f"multipart/form-data form (the file in `{FILE}`, the fields beside it), or as the "
            "raw body with its own Content-Type (application/pdf, text/markdown, ... or "
            "application/octet-stream to let the server read the type) with the fields as "
            "query parameters. Files are best sent as a form or raw: bytes, no base64.",
            "content": {
                FORM: {"schema": {"type": "object", "required": [FILE], "properties": form}},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            },
        },
        "parameters": parameters,
    }
