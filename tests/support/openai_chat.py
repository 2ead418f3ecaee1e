"""A small OpenAI-compatible chat-completions server for tests, whose answers the test scripts.

It speaks `POST /v1/chat/completions` (non-streaming): each request takes the next scripted
reply — text, tool calls, a provider error — or, when the script is empty, asks the default
responder. A reply may be a function of the request, so a scripted model can quote what its
searches returned. Every request body is kept for the test to inspect. Token usage counts
words, so it is deterministic.

    chat = ScriptedChat()
    chat.script(search("glacier"), lambda req: Text(json.dumps({"ids": tool_ids(req)})))
    async with serve_app(chat.app, lifespan="off") as url:
        ... model="openai/scripted", api_base=url + "/v1"
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

_ERROR_TYPES = {429: "rate_limit_exceeded", 400: "invalid_request_error", 401: "invalid_api_key"}


@dataclass(frozen=True)
class Text:
    """The model answers (no tool call)."""

    content: str


@dataclass(frozen=True)
class Call:
    name: str
    # A dict is sent as JSON; a string is sent as it is (malformed arguments, on purpose).
    arguments: dict[str, Any] | str


@dataclass(frozen=True)
class Calls:
    """The model calls tools (several calls in one turn are allowed)."""

    calls: tuple[Call, ...]
    content: str | None = None


@dataclass(frozen=True)
class Fail:
    """The provider answers with an HTTP error."""

    status: int
    message: str = "scripted failure"


Reply = Text | Calls | Fail
Responder = Callable[[dict[str, Any]], Reply]


def search(query: str, **arguments: Any) -> Calls:
    """One `search_knowledge_base` call."""
    return Calls((Call("search_knowledge_base", {"query": query, **arguments}),))


def tool_results(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool messages of a request, parsed (the latest last)."""
    out = []
    for message in body.get("messages", []):
        if message.get("role") == "tool":
            out.append(json.loads(message["content"]))
    return out


def tool_ids(body: dict[str, Any]) -> list[str]:
    """Chunk ids of every search result the request's conversation holds."""
    return [r["id"] for result in tool_results(body) for r in result.get("results", [])]


def message_text(body: dict[str, Any], role: str) -> str:
    """Every `role` message's text of a request, joined."""
    return "\n".join(
        str(m.get("content") or "") for m in body.get("messages", []) if m.get("role") == role
    )


@dataclass
class _State:
    script: deque[Reply | Responder] = field(default_factory=deque)
    requests: list[dict[str, Any]] = field(default_factory=list)


class ScriptedChat:
    """The server's state and ASGI app; serve `app` with `tests.support.asgi.serve_app`."""

    def __init__(self, default: Responder | Reply | None = None) -> None:
        self._lock = threading.Lock()
        self._state = _State()
        self.default = default
        self.app = self._build_app()

    def script(self, *replies: Reply | Responder) -> None:
        """Replies for the next requests, in order."""
        with self._lock:
            self._state.script.extend(replies)

    def reset(self, default: Responder | Reply | None = None) -> None:
        with self._lock:
            self._state = _State()
            self.default = default

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every request body received, failed ones included, in arrival order."""
        with self._lock:
            return list(self._state.requests)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._state.script)

    def _next(self, body: dict[str, Any]) -> Reply:
        with self._lock:
            self._state.requests.append(body)
            step = self._state.script.popleft() if self._state.script else self.default
        if step is None:
            return Fail(500, "the test scripted no reply for this request")
        return step(body) if callable(step) else step

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def completions(request: Request) -> JSONResponse:
            body: dict[str, Any] = await request.json()
            reply = self._next(body)
            if isinstance(reply, Fail):
                return JSONResponse(
                    status_code=reply.status,
                    content={
                        "error": {
                            "message": reply.message,
                            "type": _ERROR_TYPES.get(reply.status, "server_error"),
                            "param": None,
                            "code": None,
                        }
                    },
                )
            message: dict[str, Any] = {"role": "assistant", "content": None}
            if isinstance(reply, Text):
                message["content"] = reply.content
                finish = "stop"
                produced = reply.content
            else:
                message["content"] = reply.content
                message["tool_calls"] = [
                    {
                        "id": f"call_{uuid.uuid4().hex[:12]}",
                        "type": "function",
                        "function": {
                            "name": call.name,
                            "arguments": call.arguments
                            if isinstance(call.arguments, str)
                            else json.dumps(call.arguments),
                        },
                    }
                    for call in reply.calls
                ]
                finish = "tool_calls"
                produced = json.dumps(message["tool_calls"])
            prompt = sum(len(str(m.get("content") or "").split()) for m in body["messages"])
            completion = len(produced.split()) if produced else 0
            return JSONResponse(
                {
                    "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body.get("model"),
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": {
                        "prompt_tokens": prompt,
                        "completion_tokens": completion,
                        "total_tokens": prompt + completion,
                    },
                }
            )

        return app
