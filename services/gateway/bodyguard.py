"""A guard in front of every JSON request body: JSON that Python parses but nothing after it
can handle is refused with a 422 problem body before any route sees it.

- Nesting deeper than `max_depth`: parsing or encoding it again recurses until Python gives
  up (a RecursionError, a 500, and a connection reset for the client's next request).
- Lone surrogates (`"\\ud800"`): valid JSON escapes, but not Unicode; encoding them as UTF-8
  for the bus, the object store or a reply fails.

It reads the whole body; `BodyLimit` (bodylimit.py), in front of it, bounds how much there is.

Most bodies cost one `bytes.count`: fewer brackets than `max_depth` cannot nest too deep, and
without a `\\uD8xx`-`\\uDFxx` escape there is no surrogate to find.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from services.gateway.problems import problem

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_DEPTH = 32
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_METHODS = {"POST", "PUT", "PATCH"}


class JsonBodyGuard:
    def __init__(self, app: ASGIApp, *, max_depth: int = MAX_DEPTH) -> None:
        self.app = app
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _METHODS or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        body, other = await read_body(receive)
        if other is not None:
            await self.app(scope, replay(body, receive, other), send)
            return
        found = self.inspect(body)
        if found is not None:
            await self._refuse(scope, receive, send, *found)
            return
        await self.app(scope, replay(body, receive), send)

    def inspect(self, body: bytes) -> tuple[str, str] | None:
        """(field, message) of what is wrong with `body`, or None."""
        deep = body.count(b"{") + body.count(b"[") > self.max_depth
        surrogate = _SURROGATE_ESCAPE.search(body) is not None
        if not (deep or surrogate):
            return None
        try:
            value = json.loads(body)
        except RecursionError:
            return "body", f"the JSON body is nested more than {self.max_depth} levels deep"
        except ValueError:
            return None  # not JSON at all: the route's own parsing says so
        return _walk(value, self.max_depth)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, field: str, message: str
    ) -> None:
        response = problem(
            422,
            "ValidationError",
            message,
            field=field,
            errors=[{"field": field, "message": message}],
        )
        await response(scope, receive, send)


def _walk(value: Any, max_depth: int) -> tuple[str, str] | None:
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth >= max_depth:
                return path or "body", f"the JSON body is nested more than {max_depth} levels deep"
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, item in items:
                child = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not _encodable(key):
                    return child, f"{child}: a key is not valid Unicode (a lone surrogate)"
                stack.append((item, child, depth + 1))
        elif isinstance(node, str) and not _encodable(node):
            field = path or "body"
            return field, f"{field} is not valid Unicode: it contains a lone surrogate"
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def read_body(receive: Receive) -> tuple[bytes, Message | None]:
    """The request's body, and the message that cut it short (a disconnect), if any."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers", []):
        if name == b"content-type":
            media = value.split(b";")[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return True  # FastAPI reads a body without a content type as JSON too


def replay(body: bytes, receive: Receive, pending: Message | None = None) -> Receive:
    """A `receive` that hands the app the body already read, then the real channel."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent, pending
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if pending is not None:
            message, pending = pending, None
            return message
        return await receive()

    return replayed
