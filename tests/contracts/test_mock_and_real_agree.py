"""For every REST operation and every tool, the mock's answer and a real stack's answer validate
against the same schema — the contract in `contracts/` — so what a team builds against the mock
works against kbmesh. One real in-process stack (nats-server, engine, model) for the module."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import nats
import pytest

from services.contracts.examples import CHUNKS, DOC_TEXT, METADATA, QUERY, VACATION_SCHEMA
from services.contracts.export import CALL_TOOL, LIST_TOOLS, TOOLS_PATH, Contracts, OpKey, build
from services.gateway.tools import TOOLS
from tests.conftest import running_stack
from tests.support.asgi import serve_app
from tests.support.bus import bus_url
from tests.support.contracts import errors, rest_errors, send_example
from tests.support.openai_chat import ScriptedChat, Text, search, tool_ids, tool_results

FILES = build().files()


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@dataclass
class World:
    """The real stack's client and what the calls need: a KB with one indexed document."""

    http: httpx.AsyncClient
    nats_url: str = ""
    kb: str = ""
    kb_id: str = ""
    doc_id: str = ""
    chunk_id: str = ""
    prompt: str = ""
    chat_api_base: str = ""

    def ask_options(self) -> dict[str, Any]:
        """A model (the scripted chat server) and a schema for answers."""
        return {
            "model": CHAT_MODEL,
            "api_base": self.chat_api_base,
            "response_schema": VACATION_SCHEMA,
        }

    async def new_prompt(self) -> str:
        body = {"name": uid("prompt"), "kb_ids": [self.kb], **self.ask_options()}
        return (await self.ok(self.http.post("/v1/prompts", json=body)))["prompt_id"]

    async def ok(self, response: Awaitable[httpx.Response]) -> Any:
        resp = await response
        assert resp.is_success, resp.text
        return resp.json()

    async def upload(self, name: str, text: str = DOC_TEXT, **fields: Any) -> str:
        body = {"name": name, "content": text, "mime_type": "text/markdown", **fields}
        result = await self.ok(
            self.http.post(f"/v1/kbs/{self.kb}/documents", params={"wait": "true"}, json=body)
        )
        assert result["status"] == "complete", result
        return result["document_id"]

    async def new_kb(self) -> str:
        return (await self.ok(self.http.post("/v1/kbs", json={"name": uid("kb")})))["name"]

    def tool(self, name: str, arguments: dict[str, Any]) -> Awaitable[httpx.Response]:
        return self.http.post(f"{TOOLS_PATH}/{name}", json=arguments)


CHAT_MODEL = "hosted_vllm/scripted"


def vacation_answer(body: dict[str, Any]) -> Any:
    """A model that searches once, then answers in VACATION_SCHEMA citing what it found."""
    if not tool_results(body):
        return search(QUERY)
    return Text(
        json.dumps({"days_per_year": 30, "carry_over_days": 5, "sources": tool_ids(body)[:1]})
    )


@pytest.fixture(scope="module")
async def world(tmp_path_factory, embedders):
    chat = ScriptedChat(default=vacation_answer)
    async with (
        serve_app(chat.app, lifespan="off") as chat_url,
        # The scripted chat server listens on loopback: allowed, as a self-hosted model.
        running_stack(
            tmp_path_factory.mktemp("contracts"),
            embedders=embedders,
            mcp_toolsets="core,compat",
            egress={"allow_private": True},
        ) as (rt, client),
    ):
        w = World(client, bus_url(rt.bus.url, rt.settings.data_dir), chat_api_base=chat_url + "/v1")
        w.kb = await w.new_kb()
        w.kb_id = (await w.ok(client.get(f"/v1/kbs/{w.kb}")))["kb_id"]
        w.doc_id = await w.upload(
            "vacation-policy.md", tags=["hr"], metadata=METADATA, source_id="handbook"
        )
        search = await w.ok(client.post("/v1/search", json={"query": QUERY, "kb_ids": [w.kb]}))
        w.chunk_id = search["hits"][0]["chunk_id"]
        w.prompt = await w.new_prompt()
        yield w


# ---- REST -----------------------------------------------------------------------------------


async def _delete_kb(w: World) -> httpx.Response:
    return await w.http.delete(f"/v1/kbs/{await w.new_kb()}")


async def _reindex(w: World) -> httpx.Response:
    return await w.http.post(f"/v1/kbs/{await w.new_kb()}/reindex")


async def _cancel_reindex(w: World) -> httpx.Response:
    # A one-document rebuild may finish before the cancel arrives (409): try again.
    for _ in range(5):
        kb = await w.new_kb()
        await w.ok(
            w.http.post(
                f"/v1/kbs/{kb}/documents",
                params={"wait": "true"},
                json={"name": "leave.md", "content": CHUNKS[2]},
            )
        )
        await w.ok(w.http.post(f"/v1/kbs/{kb}/reindex"))
        response = await w.http.post(f"/v1/kbs/{kb}/reindex/cancel")
        if response.status_code != 409:
            return response
    return response


async def _delete_source(w: World) -> httpx.Response:
    source = uid("source")
    await w.upload("old-notes.md", CHUNKS[0], source_id=source)
    return await w.http.delete("/v1/documents", params={"source_id": source})


async def _delete_document(w: World) -> httpx.Response:
    return await w.http.delete(f"/v1/documents/{await w.upload('draft.md', CHUNKS[2])}")


async def _delete_prompt(w: World) -> httpx.Response:
    return await w.http.delete(f"/v1/prompts/{await w.new_prompt()}")


async def _dead_letter(w: World) -> int:
    """An upstream upload naming a KB that does not exist: dead-lettered at once."""
    from services.common.messages.events import DocUploaded

    event = DocUploaded(org_id="local", name="early.md", content="x", kb_id=uid("missing"))
    nc = await nats.connect(w.nats_url)
    try:
        await nc.jetstream().publish(
            "doc.uploaded", event.model_dump_json().encode(), headers={"Nats-Msg-Id": uid("e")}
        )
    finally:
        await nc.close()
    for _ in range(600):
        items = (await w.ok(w.http.get("/v1/dead-letters")))["items"]
        found = [d["sequence"] for d in items if d["kb_id"] == event.kb_id]
        if found:
            return int(found[0])
        await asyncio.sleep(0.05)
    raise AssertionError("the upload was not dead-lettered")


async def _list_dead_letters(w: World) -> httpx.Response:
    await _dead_letter(w)
    return await w.http.get("/v1/dead-letters")


async def _replay_dead_letter(w: World) -> httpx.Response:
    return await w.http.post(f"/v1/dead-letters/{await _dead_letter(w)}/replay")


async def _get_dead_letter(w: World) -> httpx.Response:
    return await w.http.get(f"/v1/dead-letters/{await _dead_letter(w)}")


async def _discard_dead_letter(w: World) -> httpx.Response:
    return await w.http.delete(f"/v1/dead-letters/{await _dead_letter(w)}")


REMOTE = "https://127.0.0.1:1/acme/handbook.git"


async def _new_source(w: World) -> dict[str, Any]:
    body = {"kind": "git", "kb": w.kb, "url": REMOTE, "name": uid("repo"), "branch": "main"}
    found: dict[str, Any] = await w.ok(w.http.post("/v1/sources", json=body))
    return found


def _on_source(method: str, tail: str = "", **kwargs: Any):
    async def call(w: World) -> httpx.Response:
        source = (await _new_source(w))["source_id"]
        return await w.http.request(method, f"/v1/sources/{source}{tail}", **kwargs)

    return call


async def _source_hook(w: World) -> httpx.Response:
    source = await _new_source(w)
    body = json.dumps({"ref": "refs/heads/main"}).encode()
    digest = hmac.new(source["webhook_secret"].encode(), body, hashlib.sha256).hexdigest()
    headers = {"X-Hub-Signature-256": f"sha256={digest}", "Content-Type": "application/json"}
    return await w.http.post(source["hook_path"], content=body, headers=headers)


REST_CALLS: dict[OpKey, Callable[[World], Awaitable[httpx.Response]]] = {
    ("POST", "/v1/sources"): lambda w: w.http.post(
        "/v1/sources", json={"kind": "git", "kb": w.kb, "url": REMOTE, "token": "t0ken"}
    ),
    ("GET", "/v1/sources"): lambda w: w.http.get("/v1/sources", params={"kb": w.kb}),
    ("GET", "/v1/sources/{source}"): _on_source("GET"),
    ("PATCH", "/v1/sources/{source}"): _on_source("PATCH", json={"enabled": False}),
    ("DELETE", "/v1/sources/{source}"): _on_source("DELETE"),
    ("POST", "/v1/sources/{source}/sync"): _on_source("POST", "/sync"),
    ("POST", "/v1/sources/{source}/hook"): _source_hook,
    ("GET", "/healthz"): lambda w: w.http.get("/healthz"),
    ("GET", "/readyz"): lambda w: w.http.get("/readyz"),
    ("POST", "/v1/kbs"): lambda w: w.http.post("/v1/kbs", json={"name": uid("kb")}),
    ("GET", "/v1/kbs"): lambda w: w.http.get("/v1/kbs"),
    ("GET", "/v1/defaults"): lambda w: w.http.get("/v1/defaults"),
    ("GET", "/v1/kbs/{kb}"): lambda w: w.http.get(f"/v1/kbs/{w.kb}"),
    ("PATCH", "/v1/kbs/{kb}"): lambda w: w.http.patch(
        f"/v1/kbs/{w.kb}", json={"description": "HR handbook"}
    ),
    ("DELETE", "/v1/kbs/{kb}"): _delete_kb,
    ("POST", "/v1/kbs/{kb}/reindex"): _reindex,
    ("POST", "/v1/kbs/{kb}/reindex/cancel"): _cancel_reindex,
    ("POST", "/v1/kbs/{kb}/retry-failed"): lambda w: w.http.post(f"/v1/kbs/{w.kb}/retry-failed"),
    ("GET", "/v1/kbs/{kb}/stats"): lambda w: w.http.get(f"/v1/kbs/{w.kb}/stats"),
    ("GET", "/v1/kbs/{kb}/documents"): lambda w: w.http.get(f"/v1/kbs/{w.kb}/documents"),
    ("POST", "/v1/kbs/{kb}/documents"): lambda w: w.http.post(
        f"/v1/kbs/{w.kb}/documents",
        params={"wait": "true"},
        json={"name": "leave.md", "content": CHUNKS[2], "tags": ["hr"]},
    ),
    ("POST", "/v1/documents"): lambda w: w.http.post(
        "/v1/documents",
        params={"wait": "true"},
        json={"name": "accrual.md", "content": CHUNKS[1], "kb_id": w.kb, "collection": "hr"},
    ),
    ("GET", "/v1/documents"): lambda w: w.http.get("/v1/documents", params={"kb": w.kb}),
    ("DELETE", "/v1/documents"): _delete_source,
    ("GET", "/v1/documents/{document_id}"): lambda w: w.http.get(f"/v1/documents/{w.doc_id}"),
    ("PATCH", "/v1/documents/{document_id}"): lambda w: w.http.patch(
        f"/v1/documents/{w.doc_id}", json={"collection": "people-ops"}
    ),
    ("DELETE", "/v1/documents/{document_id}"): _delete_document,
    ("POST", "/v1/search"): lambda w: w.http.post(
        "/v1/search", json={"query": QUERY, "kb_ids": [w.kb], "coalesce_neighbors": 1}
    ),
    ("GET", "/v1/chunks/{chunk_id}"): lambda w: w.http.get(
        f"/v1/chunks/{w.chunk_id}", params={"kb": w.kb, "neighbors": 1}
    ),
    ("POST", "/v1/ask"): lambda w: w.http.post(
        "/v1/ask", json={"question": QUERY, "kb_ids": [w.kb], **w.ask_options()}
    ),
    ("POST", "/v1/prompts"): lambda w: w.http.post(
        "/v1/prompts", json={"name": uid("prompt"), "instructions": "Extract the allowance."}
    ),
    ("GET", "/v1/prompts"): lambda w: w.http.get("/v1/prompts"),
    ("GET", "/v1/prompts/{prompt}"): lambda w: w.http.get(f"/v1/prompts/{w.prompt}"),
    ("PATCH", "/v1/prompts/{prompt}"): lambda w: w.http.patch(
        f"/v1/prompts/{w.prompt}", json={"max_iterations": 3}
    ),
    ("DELETE", "/v1/prompts/{prompt}"): _delete_prompt,
    ("POST", "/v1/prompts/{prompt}/run"): lambda w: w.http.post(
        f"/v1/prompts/{w.prompt}/run", json={"document_id": w.doc_id}
    ),
    ("GET", "/v1/dead-letters"): _list_dead_letters,
    ("GET", "/v1/types"): lambda w: w.http.get("/v1/types"),
    ("GET", "/v1/sign-in"): lambda w: w.http.get("/v1/sign-in"),
    ("POST", "/v1/dead-letters/{sequence}/replay"): _replay_dead_letter,
    ("GET", "/v1/dead-letters/{sequence}"): _get_dead_letter,
    ("DELETE", "/v1/dead-letters/{sequence}"): _discard_dead_letter,
    # The world's uploads are on the trail (keyless loopback: the org's admin).
    ("GET", "/v1/audit"): lambda w: w.http.get("/v1/audit", params={"kind": "document"}),
    LIST_TOOLS: lambda w: w.http.get(TOOLS_PATH),
    CALL_TOOL: lambda w: w.tool("kb_search", {"query": QUERY, "kb": w.kb}),
}
REST_FIXTURES = {
    (doc["method"], doc["path"]): doc for p, doc in FILES.items() if p.startswith("rest/examples/")
}


@pytest.mark.parametrize("key", sorted(REST_FIXTURES), ids=" ".join)
async def test_rest_operation_mock_and_real_answers_share_a_schema(
    world: World, mock: httpx.AsyncClient, contracts: Contracts, key: OpKey
):
    call = REST_CALLS.get(key)
    assert call is not None, f"no real call for {key}: add one to REST_CALLS"
    mocked = await send_example(mock, REST_FIXTURES[key])
    real = await call(world)
    for who, response in (("mock", mocked), ("real", real)):
        assert response.is_success, (who, response.status_code, response.text)
        if key == CALL_TOOL:
            answer_errors = errors(FILES["tools/kb_search.output.schema.json"], response.json())
        else:
            answer_errors = rest_errors(contracts, key, response)
        assert not answer_errors, (who, answer_errors)
    if key == LIST_TOOLS:
        # The fixture is the gateway's own listing of every toolset.
        assert real.json() == mocked.json()


async def test_real_errors_are_the_documented_problem_and_tool_error(
    world: World, contracts: Contracts
):
    """The gateway's failures match the error schemas the contract documents (and the mock
    answers with): a problem document for REST, the structured tool error for tools."""
    for method, path, key, kwargs in [
        ("POST", "/v1/kbs", ("POST", "/v1/kbs"), {"json": {"name": 5}}),
        ("GET", "/v1/kbs/no-such-kb", ("GET", "/v1/kbs/{kb}"), {}),
        ("DELETE", "/v1/documents", ("DELETE", "/v1/documents"), {}),
    ]:
        response = await world.http.request(method, path, **kwargs)
        assert response.status_code in (404, 422), response.text
        assert response.headers["content-type"] == "application/problem+json"
        assert not rest_errors(contracts, key, response)
    for name, arguments in [("kb_search", {"query": 5}), ("kb_stats", {"kb": "no-such-kb"})]:
        response = await world.tool(name, arguments)
        assert response.status_code in (404, 422), response.text
        assert not errors(FILES["tools/error.schema.json"], response.json())


async def test_upstream_publishes_the_event_contract_with_a_plain_nats_client(world: World):
    """contracts/README.md's recipe: the doc.uploaded example, published with nats-py and
    `Nats-Msg-Id` = event_id, is indexed; a retry with the same id is dropped as a duplicate."""
    event = dict(FILES["events/doc.uploaded.example.json"])
    event.update(
        event_id=uuid.uuid4().hex,
        document_id=uuid.uuid4().hex,
        org_id="local",  # the org of unauthenticated loopback callers, to read it back
        kb_id=world.kb_id,
    )
    nc = await nats.connect(world.nats_url)
    try:
        indexed = await nc.subscribe("doc.indexed")
        js = nc.jetstream()
        headers = {"Nats-Msg-Id": event["event_id"]}
        first = await js.publish("doc.uploaded", json.dumps(event).encode(), headers=headers)
        again = await js.publish("doc.uploaded", json.dumps(event).encode(), headers=headers)
        assert not first.duplicate and again.duplicate
        async with asyncio.timeout(120):
            while True:
                done = json.loads((await indexed.next_msg(timeout=120)).data)
                if done["document_id"] == event["document_id"]:
                    break
        assert done["kb_id"] == world.kb_id and done["chunk_count"] >= 1
    finally:
        await nc.close()
    document = await world.ok(world.http.get(f"/v1/documents/{event['document_id']}"))
    assert document["name"] == event["name"] and document["collection"] == event["collection"]


# ---- tools ----------------------------------------------------------------------------------


async def _kb_delete(w: World) -> list[httpx.Response]:
    return [await w.tool("kb_delete", {"document_id": await w.upload("tmp.md", CHUNKS[0])})]


async def _kb_delete_source(w: World) -> list[httpx.Response]:
    source = uid("repo")
    await w.upload("readme.md", CHUNKS[1], source_id=source)
    return [await w.tool("kb_delete_source", {"source_id": source})]


async def _kb_reindex(w: World) -> list[httpx.Response]:
    return [await w.tool("kb_reindex", {"kb": await w.new_kb()})]


async def _delete_document(w: World) -> list[httpx.Response]:
    uri = f"https://wiki.acme.example/{uid('page')}"
    await w.upload("page.md", CHUNKS[2], uri=uri)
    return [await w.tool("delete_document", {"filepath": uri})]


async def _manage_knowledge(w: World) -> list[httpx.Response]:
    """Each operation answers with its own subset of the one output model."""
    source = uid("sre-wiki")
    ingest = await w.tool(
        "manageKnowledge",
        {
            "operation": "ingest",
            "content": CHUNKS[1],
            "uri": f"https://wiki/{source}",
            "sourceId": source,
        },
    )
    chunk = ingest.json()["chunkIds"][0]
    return [
        ingest,
        await w.tool("manageKnowledge", {"operation": "search", "query": QUERY, "limit": 3}),
        await w.tool("manageKnowledge", {"operation": "getChunk", "chunkId": chunk}),
        await w.tool("manageKnowledge", {"operation": "deleteBySource", "sourceId": source}),
    ]


def one(name: str, arguments: Callable[[World], dict[str, Any]]):
    async def call(w: World) -> list[httpx.Response]:
        return [await w.tool(name, arguments(w))]

    return call


async def _kb_ask(w: World) -> list[httpx.Response]:
    return [
        await w.tool("kb_ask", {"question": QUERY, "kb_ids": [w.kb], **w.ask_options()}),
        await w.tool("kb_ask", {"prompt": w.prompt, "document_id": w.doc_id}),
    ]


def _source_tool(name: str, **arguments: Any):
    async def call(w: World) -> list[httpx.Response]:
        source = (await _new_source(w))["source_id"]
        return [await w.tool(name, {"source": source, **arguments})]

    return call


TOOL_CALLS: dict[str, Callable[[World], Awaitable[list[httpx.Response]]]] = {
    "kb_source_list": one("kb_source_list", lambda w: {"kb": w.kb}),
    "kb_source_get": _source_tool("kb_source_get"),
    "kb_source_add": one(
        "kb_source_add",
        lambda w: {"kind": "web", "kb": w.kb, "url": "http://127.0.0.1:1/docs/", "max_pages": 50},
    ),
    "kb_source_update": _source_tool("kb_source_update", schedule="0 */2 * * *"),
    "kb_source_sync": _source_tool("kb_source_sync"),
    "kb_source_remove": _source_tool("kb_source_remove", keep_documents=True),
    "kb_ask": _kb_ask,
    "kb_search": one("kb_search", lambda w: {"query": QUERY, "kb": w.kb, "coalesce_neighbors": 1}),
    "kb_get_chunk": one("kb_get_chunk", lambda w: {"chunk_id": w.chunk_id, "neighbors": 1}),
    "kb_upload": one(
        "kb_upload",
        lambda w: {"kb": w.kb, "name": "benefits.md", "content": CHUNKS[0], "tags": ["hr"]},
    ),
    "kb_delete": _kb_delete,
    "kb_delete_source": _kb_delete_source,
    "kb_set_collection": one(
        "kb_set_collection", lambda w: {"document_id": w.doc_id, "collection": "people-ops"}
    ),
    "kb_update_document": one(
        "kb_update_document", lambda w: {"document_id": w.doc_id, "metadata": METADATA}
    ),
    "kb_list_documents": one("kb_list_documents", lambda w: {"kb": w.kb}),
    "kb_list": one("kb_list", lambda w: {}),
    "kb_create": one("kb_create", lambda w: {"name": uid("kb"), "tag_ids": ["hr"]}),
    "kb_update": one("kb_update", lambda w: {"kb": w.kb, "description": "HR handbook"}),
    "kb_stats": one("kb_stats", lambda w: {"kb": w.kb}),
    "kb_reindex": _kb_reindex,
    "search_docs": one(
        "search_docs", lambda w: {"query": QUERY, "projectId": w.kb, "minScore": 0.0}
    ),
    "upload_document": one(
        "upload_document",
        lambda w: {"projectId": w.kb, "fileName": "expenses.md", "content": CHUNKS[2]},
    ),
    "delete_document": _delete_document,
    "manageKnowledge": _manage_knowledge,
    "search_knowledge_base": one(
        "search_knowledge_base",
        lambda w: {"query": QUERY, "coalesce_neighbors": 1, "metadata_filter": {"tag_ids": ["hr"]}},
    ),
}


@pytest.mark.parametrize("name", sorted(TOOLS))
async def test_tool_mock_and_real_answers_share_a_schema(
    world: World, mock: httpx.AsyncClient, name: str
):
    call = TOOL_CALLS.get(name)
    assert call is not None, f"no real call for tool {name}: add one to TOOL_CALLS"
    schema = FILES[f"tools/{name}.output.schema.json"]
    answers = [
        ("mock", await mock.post(f"{TOOLS_PATH}/{name}", json=example["input"]))
        for example in FILES[f"tools/{name}.examples.json"]
    ]
    answers += [("real", response) for response in await call(world)]
    for who, response in answers:
        assert response.status_code == 200, (who, response.text)
        assert not errors(schema, response.json()), (who, response.json())
