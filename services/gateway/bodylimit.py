"""How large a request body may be, route by route, and `BodyLimit`, which holds every
request to it: from its `Content-Length` before a byte is read, and by counting while it is
read (a chunked body declares no length). A body over its limit is answered 413 and its
connection closed with the rest unread, so no caller, whatever its key allows, can make the
gateway hold more than one limit's worth of a body in memory.

The rule is one table: routes whose body carries a document's content (REST uploads, the
upload tools, MCP, whose `tools/call` of `kb_upload` cannot be told from a search before it
is read) take the upload limit; every other body is a small JSON one.
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.settings import Settings
from services.gateway.guard import refusal
from services.gateway.tools import TOOLS

# A search, an answer's instructions and response schema, a KB's settings, a tool call
# without content: the largest of them is a few tens of kilobytes.
JSON_BODY_BYTES = 1024 * 1024
# Everything of an upload besides its content and metadata: name, uri, 100 tags of 200
# characters (escaped in JSON), multipart boundaries and part headers.
FRAMING_BYTES = 256 * 1024
# How much larger than its UTF-8 bytes text may grow in a JSON body: a client that escapes
# everything outside ASCII (Python's json.dumps by default, hence `requests`) writes the two
# bytes of "é" as the six of "\u00e9". Base64 needs 4/3.
JSON_EXPANSION = 3

# The tools whose input takes a document's `content` (kb_upload, upload_document,
# manageKnowledge), read from the registry so that a new one is not missed.
_CONTENT_TOOLS = "|".join(
    sorted(
        re.escape(name)
        for name, spec in TOOLS.items()
        if "content" in spec.input_model.model_fields
    )
)
# (method, path) of the routes whose body carries a document's content, whatever its media
# type (JSON, multipart, raw).
UPLOAD_ROUTES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("POST", re.compile(r"/v1/documents/?")),
    ("POST", re.compile(r"/v1/kbs/[^/]+/documents/?")),
    ("POST", re.compile(rf"/api/v1/tools/(?:{_CONTENT_TOOLS})/?")),
    ("POST", re.compile(r"/mcp(?:/.*)?")),
)


def is_upload(method: str, path: str) -> bool:
    return any(method == m and pattern.fullmatch(path) for m, pattern in UPLOAD_ROUTES)


def is_json(media_type: str | None) -> bool:
    """JSON, or no type at all (FastAPI reads a body without one as JSON)."""
    if media_type is None:
        return True
    kind = media_type.split(";")[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")


def upload_body_bytes(settings: Settings, media_type: str | None) -> int:
    """The largest body that can carry a document within the limits: its content (as it is
    in multipart or raw bytes; base64 or escaped text in JSON), its metadata (JSON, escaped),
    and the other fields and framing."""
    content = settings.max_content_bytes * (JSON_EXPANSION if is_json(media_type) else 1)
    return content + JSON_EXPANSION * settings.limits.metadata_bytes + FRAMING_BYTES


def json_body_bytes(settings: Settings) -> int:
    """The largest body of any other route: a document's metadata (a PATCH) fits."""
    return max(JSON_BODY_BYTES, JSON_EXPANSION * settings.limits.metadata_bytes + FRAMING_BYTES)


def body_limit(settings: Settings, method: str, path: str, media_type: str | None) -> int:
    """The most bytes the body of `method path` sent as `media_type` may have."""
    if is_upload(method, path):
        return upload_body_bytes(settings, media_type)
    return json_body_bytes(settings)


def largest_body_bytes(settings: Settings) -> int:
    """The largest body any route takes: what the server's body deadline allows time for."""
    return max(upload_body_bytes(settings, "application/json"), json_body_bytes(settings))


def too_large(scope: Scope, settings: Settings, limit: int) -> Response:
    """The 413 that refuses the request, closing its connection: reading the rest of the
    body to keep the connection would be reading what was refused."""
    message = f"the request body is larger than {limit} bytes, the most this route takes"
    if is_upload(scope["method"], scope["path"]):
        message += (
            f" (a document's content may have {settings.max_content_bytes} bytes, "
            "KBMESH_MAX_CONTENT_BYTES)"
        )
    response = refusal(scope, 413, "ContentTooLarge", message)
    response.headers["Connection"] = "close"
    return response


class BodyLimit:
    """The first middleware that reads a body: it holds each request to `body_limit`."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        limit = body_limit(
            self.settings, scope["method"], scope["path"], headers.get("content-type")
        )
        declared = headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > limit:
            await too_large(scope, self.settings, limit)(scope, receive, send)
            return
        counter = _Counter(scope, receive, send, limit, self.settings)
        try:
            await self.app(scope, counter.receive, counter.send)
        except Exception:
            # Once the 413 has answered, the app fails for want of the body it was refused
            # (a disconnect where its body should be); that failure is the refusal's.
            if not counter.answered:
                raise


class _Counter:
    """The app's `receive` and `send` for one request: past `limit` bytes of body, the 413
    answers in the app's place (unless the app has begun its own answer), the app is told
    the client is gone, and whatever it sends then goes nowhere."""

    def __init__(
        self, scope: Scope, receive: Receive, send: Send, limit: int, settings: Settings
    ) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self.limit = limit
        self.settings = settings
        self.received = 0
        self.refused = False
        self.responding = False
        self.answered = False

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.refused = True
                if not self.responding:
                    self.answered = True
                    await too_large(self.scope, self.settings, self.limit)(
                        self.scope, self._receive, self._send
                    )
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.responding = True
        await self._send(message)
