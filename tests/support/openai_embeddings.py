"""A small OpenAI-compatible embeddings server for tests, run in-process on a free port.

It speaks `POST /v1/embeddings` (float and base64 encodings), returns deterministic vectors
derived from each input's hash (deliberately not unit length, so clients must normalise),
and can be told to fail its next N requests with a given status to exercise retries.

    with OpenAIEmbeddingsServer(dim=16) as server:
        server.fail_next(2, status=500)
        ... litellm.aembedding(model="openai/test-embed", api_base=server.base_url, api_key="test")
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

_ERROR_TYPES = {429: "rate_limit_exceeded", 400: "invalid_request_error", 401: "invalid_api_key"}


def fake_embedding(text: str, dim: int) -> list[float]:
    """The raw vector the server returns for `text`: seeded by its SHA-256, length ≈ 3·√dim."""
    seed = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
    return (np.random.default_rng(seed).standard_normal(dim) * 3.0).astype(np.float32).tolist()


def unit(vector: list[float]) -> list[float]:
    arr = np.asarray(vector, dtype=np.float64)
    return (arr / np.linalg.norm(arr)).tolist()


@dataclass
class _Script:
    failures: list[tuple[int, str]] = field(default_factory=list)
    poison: str | None = None
    delay_seconds: float = 0.0
    rejected: list[list[str]] = field(default_factory=list)
    requests: int = 0
    held: int = 0  # requests waiting at a closed gate
    batches: list[list[str]] = field(default_factory=list)
    models: list[str] = field(default_factory=list)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ready: threading.Event) -> None:
        super().__init__(config)
        self._ready = ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._ready.set()


class OpenAIEmbeddingsServer:
    """Deterministic OpenAI embeddings endpoint; `base_url` is what LiteLLM's `api_base` takes."""

    def __init__(self, dim: int = 16) -> None:
        self.dim = dim
        self._lock = threading.Lock()
        self._script = _Script()
        self._gate = threading.Event()
        self._gate.set()
        self._socket: socket.socket | None = None
        self._port: int | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    # ---- observation and scripting (thread-safe) -----------------------------------------

    @property
    def requests(self) -> int:
        """Every embeddings request received, failed ones included."""
        with self._lock:
            return self._script.requests

    @property
    def batches(self) -> list[list[str]]:
        """Inputs of each successful request, in arrival order."""
        with self._lock:
            return [list(b) for b in self._script.batches]

    @property
    def models(self) -> list[str]:
        with self._lock:
            return list(self._script.models)

    def fail_next(self, count: int, status: int = 500, message: str = "scripted failure") -> None:
        """Answer the next `count` requests with `status` instead of vectors."""
        with self._lock:
            self._script.failures.extend([(status, message)] * count)

    def reject_inputs_containing(self, marker: str | None) -> None:
        """Answer 400 to every request with an input containing `marker`, as a provider
        rejects one bad input (content policy, over-long text) and with it its whole request."""
        with self._lock:
            self._script.poison = marker

    def delay(self, seconds: float) -> None:
        """Take `seconds` over each request, as a busy provider does."""
        with self._lock:
            self._script.delay_seconds = seconds

    def hold(self) -> None:
        """Keep every request waiting until `release`, as a stalled provider does."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    @property
    def held(self) -> int:
        """Requests now waiting for `release`."""
        with self._lock:
            return self._script.held

    @property
    def rejected(self) -> list[list[str]]:
        """Inputs of each request refused for a poisoned input."""
        with self._lock:
            return [list(b) for b in self._script.rejected]

    def reset(self) -> None:
        self._gate.set()
        with self._lock:
            self._script = _Script()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("server not started")
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # ---- app ------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/embeddings")
        async def embeddings(request: Request) -> JSONResponse:
            body: dict[str, Any] = await request.json()
            with self._lock:
                self._script.requests += 1
                failure = self._script.failures.pop(0) if self._script.failures else None
            if failure is not None:
                status, message = failure
                return JSONResponse(
                    status_code=status,
                    content={
                        "error": {
                            "message": message,
                            "type": _ERROR_TYPES.get(status, "server_error"),
                            "param": None,
                            "code": None,
                        }
                    },
                )
            raw = body.get("input", [])
            inputs = [raw] if isinstance(raw, str) else [str(x) for x in raw]
            with self._lock:
                poison, delay = self._script.poison, self._script.delay_seconds
            if delay:
                await asyncio.sleep(delay)
            if not self._gate.is_set():
                with self._lock:
                    self._script.held += 1
                await asyncio.to_thread(self._gate.wait)
                with self._lock:
                    self._script.held -= 1
            if poison is not None and any(poison in text for text in inputs):
                with self._lock:
                    self._script.rejected.append(inputs)
                return JSONResponse(
                    status_code=400,
                    content={
                        "error": {
                            "message": "input rejected by content policy",
                            "type": "invalid_request_error",
                        }
                    },
                )
            if not inputs or any(not text for text in inputs):
                return JSONResponse(
                    status_code=400,
                    content={
                        "error": {
                            "message": "input must be non-empty strings",
                            "type": "invalid_request_error",
                        }
                    },
                )
            base64_format = body.get("encoding_format") == "base64"
            data = []
            for i, text in enumerate(inputs):
                vector = fake_embedding(text, self.dim)
                encoded: Any = (
                    base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
                    if base64_format
                    else vector
                )
                data.append({"object": "embedding", "index": i, "embedding": encoded})
            tokens = sum(len(text.split()) for text in inputs)
            with self._lock:
                self._script.batches.append(inputs)
                self._script.models.append(str(body.get("model")))
            return JSONResponse(
                {
                    "object": "list",
                    "data": data,
                    "model": body.get("model"),
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )

        return app

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> OpenAIEmbeddingsServer:
        # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on connections whose
        # socket says TCP, and without it each response (headers, then body) waited ~40 ms
        # for the client's delayed ACK on a kept-alive connection.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self._socket = sock
        self._port = int(sock.getsockname()[1])
        ready = threading.Event()
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            lifespan="off",
            ws="none",
            loop="asyncio",
            timeout_graceful_shutdown=2,
        )
        self._server = _Server(config, ready)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            daemon=True,
            name=f"openai-embeddings-{self.port}",
        )
        self._thread.start()
        if not ready.wait(timeout=10):
            self.stop()
            raise RuntimeError("embeddings test server did not start within 10 s")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = None

    def __enter__(self) -> OpenAIEmbeddingsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
