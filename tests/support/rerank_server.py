"""A small server speaking Cohere's rerank protocol (`POST /v1/rerank` and `/v2/rerank`, as
Jina, Infinity and TEI's Cohere-style routes do), for tests of reranking through LiteLLM.

Its judgement is scripted and easy to predict: documents containing `prefer` (any case)
come first, the others after them; within each group the order given is reversed, so a
reranked answer always differs from the order it was sent in. `fail_next` makes the next
requests fail with a status, `garbage_next` answer with an index that does not exist.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.support.asgi import serve_app


@dataclass
class RerankScript:
    prefer: str = ""
    failures: list[int] = field(default_factory=list)
    garbage: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)

    def fail_next(self, count: int = 1, status: int = 500) -> None:
        self.failures.extend([status] * count)

    def garbage_next(self, count: int = 1) -> None:
        self.garbage += count


def rerank_app(script: RerankScript) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: Request) -> JSONResponse:
        body: dict[str, Any] = await request.json()
        script.requests.append(body)
        if script.failures:
            status = script.failures.pop(0)
            return JSONResponse(status_code=status, content={"message": "scripted failure"})
        documents = [d if isinstance(d, str) else d.get("text", "") for d in body["documents"]]
        n = len(documents)
        if script.garbage:
            script.garbage -= 1
            return JSONResponse({"id": "r", "results": [{"index": n + 5, "relevance_score": 1}]})
        scores = [
            (1.0 if script.prefer and script.prefer.lower() in text.lower() else 0.0)
            + 0.5 * (i + 1) / (n + 1)
            for i, text in enumerate(documents)
        ]
        order = sorted(range(n), key=lambda i: -scores[i])[: body.get("top_n") or n]
        results = [{"index": i, "relevance_score": round(scores[i] / 1.5, 6)} for i in order]
        return JSONResponse(
            {"id": "rerank-test", "results": results, "meta": {"billed_units": {"search_units": 1}}}
        )

    return app


@contextlib.asynccontextmanager
async def rerank_server() -> AsyncIterator[tuple[str, RerankScript]]:
    """Yields (base URL for `rerank_api_base`, the script)."""
    script = RerankScript()
    async with serve_app(rerank_app(script), lifespan="off") as base:
        yield base, script
