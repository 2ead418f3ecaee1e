"""Reranking the best fused candidates with any LiteLLM rerank model: Cohere, Jina, Voyage,
or a self-hosted server speaking one of their protocols (TEI, Infinity) via `api_base`.

A reranker is an optional improvement, never a dependency: `RerankFailed` tells search to
keep its own order and say so in the response.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from services.common.domain.errors import KbmeshError
from services.common.outbound.egress import EgressPolicy, egress_scope, refusal_in
from services.common.outbound.modelcalls import check_destination, http_client, import_litellm

_WHAT = "call the rerank model at"


class RerankFailed(Exception):
    """The reranker did not answer, or answered something unusable."""


class Reranker(Protocol):
    async def rerank(
        self, model: str, api_base: str | None, query: str, documents: Sequence[str]
    ) -> list[tuple[int, float]]:
        """(index into documents, relevance score), most relevant first, every index once."""


class LiteLLMReranker:
    def __init__(self, timeout_seconds: float = 10.0, egress: EgressPolicy | None = None) -> None:
        self.timeout_seconds = timeout_seconds
        self.egress = egress

    async def rerank(
        self, model: str, api_base: str | None, query: str, documents: Sequence[str]
    ) -> list[tuple[int, float]]:
        # None: unrestricted (tests with their own servers); search passes the operator's.
        policy = self.egress or EgressPolicy(allow_private=True)
        field = "rerank_api_base" if api_base else "rerank_model"

        async def call() -> Any:
            # The first `import litellm` takes seconds: it counts against the timeout too,
            # and finishes in its thread for the next search if it runs out.
            litellm = await asyncio.to_thread(import_litellm)
            await check_destination(policy, model, api_base, model_field=field, what=_WHAT)
            with egress_scope(policy, field=field, what=_WHAT):
                return await litellm.arerank(
                    model=model,
                    query=query,
                    documents=list(documents),
                    top_n=len(documents),
                    api_base=api_base,
                    max_retries=0,
                    **http_client(model, api_base),
                )

        try:
            response = await asyncio.wait_for(call(), self.timeout_seconds)
        except TimeoutError as err:
            raise RerankFailed(f"no answer within {self.timeout_seconds:g} s") from err
        except KbmeshError as err:
            raise RerankFailed(err.message) from err
        except Exception as err:
            refused = refusal_in(err)
            if refused is not None:
                raise RerankFailed(refused.message) from err
            # The provider's body stays out: whoever runs api_base chose its words.
            status = getattr(err, "status_code", None)
            kind = type(err).__name__
            raise RerankFailed(
                f"HTTP {status}, {kind}" if isinstance(status, int) else kind
            ) from err
        return ranked(response.results or [], len(documents))


def ranked(results: Sequence[object], n: int) -> list[tuple[int, float]]:
    """The reranker's answer, checked: every returned index valid and once, best first.
    Documents it left out (a top_n it chose itself) follow in their given order, below."""
    seen: dict[int, float] = {}
    for item in results:
        index = item.get("index") if isinstance(item, dict) else getattr(item, "index", None)
        score = (
            item.get("relevance_score")
            if isinstance(item, dict)
            else getattr(item, "relevance_score", None)
        )
        if not isinstance(index, int) or not 0 <= index < n or index in seen:
            raise RerankFailed(f"the reranker returned an invalid index: {index!r}")
        if not isinstance(score, int | float):
            raise RerankFailed(f"the reranker returned no score for document {index}")
        seen[index] = float(score)
    if not seen:
        raise RerankFailed("the reranker returned no results")
    order = sorted(seen, key=lambda i: -seen[i])
    floor = min(seen.values())
    return [(i, seen[i]) for i in order] + [(i, floor) for i in range(n) if i not in seen]
