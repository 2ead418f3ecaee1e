"""Model calls (embedding, chat, rerank) under the egress policy: a redirect from an allowed
host to a refused address never delivers the request, a provider's built-in address is held
to the policy like an api_base, and a stored prompt's model address is checked at save.

Each model server is a small local server speaking the provider's wire protocol. Loopback is
allowed only by host name (`localhost`), so the first hop, addressed by name, is allowed while
the redirect's target, `127.0.0.1`, is not.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.common.domain.errors import Forbidden, InvalidInput
from services.common.embedders import LiteLLMEmbedder
from services.common.outbound.egress import (
    EgressPolicy,
    EgressRefused,
    EgressTransport,
    egress_scope,
)
from services.search.llm import LiteLLMChat
from services.search.rerank import LiteLLMReranker, RerankFailed
from tests.conftest import running_stack
from tests.support.asgi import serve_app
from tests.support.openai_chat import ScriptedChat, Text
from tests.support.openai_embeddings import OpenAIEmbeddingsServer
from tests.support.rerank_server import rerank_server

BY_NAME = EgressPolicy.parse(["localhost"])


@contextlib.asynccontextmanager
async def redirector(target: str) -> AsyncIterator[tuple[str, list[str]]]:
    """A server that answers every request with 307 to the same path on `target`; yields
    its base URL spelt with the host name `localhost`, and the paths it was asked for."""
    asked: list[str] = []

    async def moved(request: Request) -> Response:
        asked.append(request.url.path)
        return Response(status_code=307, headers={"location": target + request.url.path})

    app = Starlette(routes=[Route("/{path:path}", moved, methods=["GET", "POST"])])
    async with serve_app(app, lifespan="off") as base:
        yield base.replace("127.0.0.1", "localhost"), asked


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    """A stack with the default egress policy: public addresses only."""
    async with running_stack(tmp_path_factory.mktemp("egress"), embedders=embedders) as (
        rt,
        client,
    ):
        yield SimpleNamespace(rt=rt, client=client)


@pytest.fixture
def embeddings():
    server = OpenAIEmbeddingsServer(dim=8).start()
    yield server
    server.stop()


async def test_an_embedding_request_redirected_to_loopback_never_reaches_it(embeddings):
    """The embedding model at an allowed name answers 307 to 127.0.0.1: the call fails as the
    provider's error and the server on 127.0.0.1 receives nothing (no text leaves)."""
    async with redirector(embeddings.base_url.removesuffix("/v1")) as (base, asked):
        embedder = LiteLLMEmbedder(
            "openai/test-embed", api_base=f"{base}/v1", api_key="test", tries=1, egress=BY_NAME
        )
        with pytest.raises(InvalidInput) as err:
            await embedder.embed(["the secret document text"])
    assert "307" in err.value.message
    assert asked == ["/v1/embeddings"]  # the allowed first hop was asked, once
    assert embeddings.requests == 0


async def test_a_chat_request_redirected_to_loopback_never_reaches_it():
    """The same for the chat model (LiteLLM's own HTTP handler, not the OpenAI SDK): the
    system prompt and document text never reach the redirect's target."""
    chat = ScriptedChat(Text("should not be asked"))
    async with (
        serve_app(chat.app, lifespan="off") as target,
        redirector(target) as (base, asked),
    ):
        model = LiteLLMChat("hosted_vllm/scripted", f"{base}/v1", tries=1, egress=lambda: BY_NAME)
        await model.check()
        with pytest.raises(InvalidInput) as err:
            await model.complete([{"role": "system", "content": "the system prompt"}])
    assert "307" in err.value.message
    assert asked == ["/v1/chat/completions"]
    assert chat.requests == []


async def test_a_rerank_request_redirected_to_loopback_never_reaches_it(monkeypatch):
    """The same for the reranker: search keeps its own order (RerankFailed), the target
    receives nothing."""
    monkeypatch.setenv("COHERE_API_KEY", "test")
    async with rerank_server() as (target, script), redirector(target) as (base, asked):
        # A generous timeout: the first `import litellm` counts against it.
        reranker = LiteLLMReranker(60.0, egress=BY_NAME)
        with pytest.raises(RerankFailed):
            await reranker.rerank("cohere/rerank-english-v3.0", base, "q", ["a", "b"])
    assert len(asked) == 1 and asked[0].endswith("/rerank")
    assert script.requests == []


async def test_the_transport_vets_every_hop_of_a_client_that_follows_redirects(embeddings):
    """Where a client does follow redirects, the egress transport checks each hop where it is
    sent: the allowed first hop goes out, the 307 to 127.0.0.1 is refused before connecting."""
    async with (
        redirector(embeddings.base_url.removesuffix("/v1")) as (base, asked),
        httpx.AsyncClient(transport=EgressTransport(), follow_redirects=True) as client,
    ):
        with (
            egress_scope(BY_NAME, field="api_base", what="call the model at"),
            pytest.raises(EgressRefused) as err,
        ):
            await client.post(f"{base}/v1/embeddings", json={"input": ["x"], "model": "m"})
        # Outside any scope the strictest policy holds: loopback by name is refused too.
        with pytest.raises(EgressRefused):
            await client.post(f"{base}/v1/embeddings", json={"input": ["x"], "model": "m"})
    assert "127.0.0.1" in err.value.message and err.value.field == "api_base"
    assert asked == ["/v1/embeddings"]  # the first hop went out; the second did not
    assert embeddings.requests == 0


async def test_a_providers_default_address_is_held_to_the_policy():
    """`ollama/...` without api_base would call http://localhost:11434: refused (Forbidden,
    naming the model field and api_base) for embeddings and chat alike, before any request;
    allowing loopback lets the check pass."""
    embedder = LiteLLMEmbedder("ollama/nomic-embed-text", tries=1, egress=EgressPolicy())
    with pytest.raises(Forbidden) as err:
        await embedder.embed(["x"])
    assert err.value.field == "embedding_model"
    assert "localhost" in err.value.message and "api_base" in err.value.message
    chat = LiteLLMChat("ollama_chat/llama3.1", None, egress=lambda: EgressPolicy())
    with pytest.raises(Forbidden) as err:
        await chat.check()
    assert err.value.field == "model"
    await LiteLLMChat(
        "ollama_chat/llama3.1", None, egress=lambda: EgressPolicy(allow_private=True)
    ).check()


async def test_a_kb_on_a_providers_loopback_default_is_refused_at_creation(stack):
    """A KB whose embedding model is `ollama/...` without api_base is refused with 403 before
    it is saved, as a loopback api_base is."""
    name = f"kb-{uuid.uuid4().hex[:8]}"
    r = await stack.client.post(
        "/v1/kbs", json={"name": name, "embedding_model": "ollama/nomic-embed-text"}
    )
    assert r.status_code == 403, r.text
    assert r.json()["field"] == "embedding_model"
    assert (await stack.client.get(f"/v1/kbs/{name}")).status_code == 404


async def test_a_stored_prompt_is_checked_at_save_like_a_kb(stack):
    """A prompt with a loopback api_base, or a model whose provider defaults to loopback, is
    refused with 403 at creation and at update; nothing is stored."""
    name = f"p-{uuid.uuid4().hex[:8]}"
    r = await stack.client.post(
        "/v1/prompts",
        json={
            "name": name,
            "instructions": "answer",
            "model": "hosted_vllm/scripted",
            "api_base": "http://127.0.0.1:9/v1",
        },
    )
    assert r.status_code == 403, r.text
    assert r.json()["field"] == "api_base"
    r = await stack.client.post(
        "/v1/prompts",
        json={"name": name, "instructions": "answer", "model": "ollama_chat/llama3.1"},
    )
    assert r.status_code == 403, r.text
    assert r.json()["field"] == "model"
    assert name not in (await stack.client.get("/v1/prompts")).text
    r = await stack.client.post(
        "/v1/prompts",
        json={"name": name, "instructions": "answer", "model": "openai/gpt-4o-mini"},
    )
    assert r.status_code == 201, r.text
    r = await stack.client.patch(f"/v1/prompts/{name}", json={"api_base": "http://[::1]:9/v1"})
    assert r.status_code == 403, r.text
    assert (await stack.client.get(f"/v1/prompts/{name}")).json()["api_base"] is None
