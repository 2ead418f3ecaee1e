"""Answers through the real bus, search service, store and model, with LiteLLM's own client
talking to a scripted OpenAI-compatible chat server.

The loop on `search.ask` (searches, schema-following answers and their repair, citations, the
iteration limit, documents to work on, key scope, provider errors, traces), then the same
flows through the gateway: `POST /v1/ask`, stored prompts (`/v1/prompts`), the MCP tool
`kb_ask` over streamable HTTP and `POST /api/v1/tools/kb_ask`, with API keys."""

from __future__ import annotations

import json
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.messages.answers import AskRequest
from services.common.messages.names import Subject
from services.common.outbound.modelcalls import MODEL_TRIES
from tests.conftest import running_stack
from tests.support.asgi import serve_app
from tests.support.bus import OperatorKeys
from tests.support.domain import LONG_DOCS, create_kb, upload
from tests.support.mcp_client import failed, http_session, ok, serve_http
from tests.support.openai_chat import (
    Call,
    Calls,
    Fail,
    ScriptedChat,
    Text,
    message_text,
    search,
    tool_results,
)

MODEL = "hosted_vllm/scripted"  # LiteLLM's vLLM provider: OpenAI protocol, no key needed
SECRET = "The vault combination for the espresso machine room is 4-8-15-16."
CONTRACT = (
    "Service agreement between Acme Glaciology Ltd and the city water board. Acme measures "
    "meltwater from the Rhone glacier every month and reports flow in cubic metres. The "
    "agreement runs for three years from 1 March 2025."
)
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "sources": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["answer", "sources"],
    "additionalProperties": False,
}
EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
async def chat():
    server = ScriptedChat()
    async with serve_app(server.app, lifespan="off") as url:
        server.base_url = url + "/v1"  # type: ignore[attr-defined]
        yield server


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    async with (
        running_stack(
            tmp_path_factory.mktemp("ask"),
            embedders=embedders,
            span_processors=[SimpleSpanProcessor(EXPORTER)],
            # The scripted chat server listens on loopback: allowed, as a self-hosted model.
            egress={"allow_private": True},
        ) as (rt, client),
        serve_http(rt) as (base, _app),
    ):
        rt.mcp_base = base  # type: ignore[attr-defined]
        yield rt, client


@pytest.fixture(scope="module")
async def world(stack) -> dict[str, Any]:
    """KB `science` holds the three long documents and a contract; KB `private` holds a
    secret that shares words with the espresso document. Keys: `admin` (the whole org),
    `scoped` (only `science`) and `reader` (read-only)."""
    rt, client = stack
    science = await create_kb(client, name="science", description="glaciers, coffee, Raft")
    private = await create_kb(client, name="private")
    docs = {}
    for name, text in LONG_DOCS.items():
        docs[name] = (await upload(client, name, text, kb_id=science["kb_id"]))["document_id"]
    docs["contract.txt"] = (await upload(client, "contract.txt", CONTRACT, kb_id=science["kb_id"]))[
        "document_id"
    ]
    docs["vault.txt"] = (await upload(client, "vault.txt", SECRET, kb_id=private["kb_id"]))[
        "document_id"
    ]
    # From here on every gateway call needs a key.
    resolver = OperatorKeys(rt)
    org = rt.settings.default_org
    keys = {
        "admin": await resolver.create(org, name="admin"),
        "scoped": await resolver.create(org, name="science only", kb_ids=[science["kb_id"]]),
        "reader": await resolver.create(org, name="reader", read_only=True),
    }
    return {
        "science": science["kb_id"],
        "private": private["kb_id"],
        "docs": docs,
        "keys": {name: {"Authorization": f"Bearer {key}"} for name, key in keys.items()},
        "tokens": keys,
    }


@pytest.fixture(autouse=True)
def fresh_script(chat):
    chat.reset()
    EXPORTER.clear()


async def ask(rt: Any, chat: ScriptedChat, **body: Any) -> dict[str, Any]:
    """One `search.ask` request over the bus, as the gateway sends it."""
    body.setdefault("model", MODEL)
    body.setdefault("api_base", chat.base_url)  # type: ignore[attr-defined]
    body.setdefault("org_id", rt.settings.default_org)
    return await rt.bus.request(Subject.SEARCH_ASK, AskRequest(**body), timeout=60)


def cite_source(name: str, answer: str = "found it") -> Any:
    """A scripted answer that follows ANSWER_SCHEMA and cites the first retrieved chunk of
    document `name`."""

    def respond(body: dict[str, Any]) -> Text:
        ids = [
            r["id"]
            for result in tool_results(body)
            for r in result["results"]
            if r["source"] == name
        ]
        return Text(json.dumps({"answer": answer, "sources": ids[:1]}))

    return respond


def words(body: dict[str, Any]) -> int:
    return sum(len(str(m.get("content") or "").split()) for m in body["messages"])


async def test_one_search_then_a_schema_answer_citing_the_document(stack, world, chat):
    """The model searches once, then answers in the schema citing the espresso chunk:
    two model calls, one search, the citation resolved to its document, usage summed."""
    rt, _ = stack
    chat.script(search("espresso grind size crema shot"), cite_source("espresso.md", "grind"))
    reply = await ask(
        rt,
        chat,
        question="How does grind size change an espresso shot?",
        kb_ids=["science"],
        instructions="Answer in one sentence.",
        response_schema=ANSWER_SCHEMA,
    )
    out = reply["result"]
    assert out["iterations"] == 2
    assert out["stopped"] == "answered"
    assert out["model"] == MODEL
    assert [s["query"] for s in out["searches"]] == ["espresso grind size crema shot"]
    assert out["searches"][0]["hit_count"] == len(out["retrieved"]) > 0
    assert out["answer"]["answer"] == "grind"
    [citation] = out["citations"]
    assert citation["chunk_id"] == out["answer"]["sources"][0]
    assert citation["document_id"] == world["docs"]["espresso.md"]
    assert citation["document_name"] == "espresso.md"
    assert citation["kb_id"] == world["science"]
    cited = next(h for h in out["retrieved"] if h["chunk_id"] == citation["chunk_id"])
    assert cited["chunk_index"] == citation["chunk_index"]
    assert "espresso" in cited["content"].lower()

    first, second = chat.requests
    assert [t["function"]["name"] for t in first["tools"]] == ["search_knowledge_base"]
    assert first["tool_choice"] == "auto"
    assert first["response_format"]["json_schema"]["schema"] == ANSWER_SCHEMA
    system = message_text(first, "system")
    assert "Answer in one sentence." in system and "science" in system
    [result] = tool_results(second)
    assert result["query"] == "espresso grind size crema shot"
    assert result["sources_searched"] == 1
    assert {"id", "content", "source", "relevance", "is_matched", "chunk_index"} <= set(
        result["results"][0]
    )
    assert out["usage"]["prompt_tokens"] == words(first) + words(second)
    assert out["usage"]["completion_tokens"] > 0


async def test_a_model_that_always_searches_stops_at_max_iterations(stack, world, chat):
    """Every call with tools enabled searches; after max_iterations calls the model is
    asked once more with tools disabled and that answer is returned."""
    rt, _ = stack

    def always_search(body: dict[str, Any]) -> Any:
        if body.get("tool_choice") == "none":
            return Text("Glaciers flow under their own weight.")
        return search(f"glacier flow {len(chat.requests)}")

    chat.reset(default=always_search)
    out = (await ask(rt, chat, question="Why do glaciers move?", max_iterations=3))["result"]
    assert out["stopped"] == "iteration_limit"
    assert out["iterations"] == 4
    assert len(out["searches"]) == 3
    assert out["answer"] == "Glaciers flow under their own weight."
    assert out["citations"] == []
    final = chat.requests[-1]
    assert final["tool_choice"] == "none"
    assert "final answer" in message_text(final, "user")
    assert [r.get("tool_choice") for r in chat.requests[:-1]] == ["auto"] * 3


async def test_invalid_json_once_is_repaired(stack, world, chat):
    """An answer that is not JSON gets one repair round with the reason; the repaired
    answer is returned."""
    rt, _ = stack
    chat.script(
        search("raft leader election"),
        Text("The leader is elected by majority vote."),
        cite_source("raft.md", "majority vote"),
    )
    out = (
        await ask(rt, chat, question="How is a Raft leader elected?", response_schema=ANSWER_SCHEMA)
    )["result"]
    assert out["iterations"] == 3
    assert out["answer"]["answer"] == "majority vote"
    assert [c["document_name"] for c in out["citations"]] == ["raft.md"]
    repair = chat.requests[-1]
    assert "not JSON" in repair["messages"][-1]["content"]
    assert repair["tool_choice"] == "none"


async def test_invalid_twice_is_a_bad_model_output_error_with_the_reason(stack, world, chat):
    """Still invalid after the repair round: the request fails with BadModelOutput, naming
    the schema violation and quoting the model's last output."""
    rt, _ = stack
    chat.script(
        search("raft"),
        Text(json.dumps({"answer": 42})),
        Text(json.dumps({"answer": "forty-two"})),
    )
    reply = await ask(rt, chat, question="Raft?", response_schema=ANSWER_SCHEMA)
    error = reply["error"]
    assert error["error_type"] == "BadModelOutput"
    assert error["field"] == "response_schema"
    assert "'sources' is a required property" in error["message"]
    assert '{"answer": "forty-two"}' in error["message"]
    assert "42 is not of type 'string'" in chat.requests[-1]["messages"][-1]["content"]


async def test_malformed_tool_arguments_go_back_to_the_model(stack, world, chat):
    """Arguments that are not JSON, miss the query or break a range are answered with a tool
    error; the model can correct itself and the loop goes on."""
    rt, _ = stack
    chat.script(
        Calls(
            (
                Call("search_knowledge_base", "{not json"),
                Call("search_knowledge_base", {"top_k": 3}),
                Call("search_knowledge_base", {"query": "glacier", "top_k": 500}),
                Call("delete_everything", {}),
            )
        ),
        search("glacier"),
        Text("done"),
    )
    out = (await ask(rt, chat, question="glaciers?"))["result"]
    assert out["answer"] == "done"
    assert out["iterations"] == 3
    assert [s["query"] for s in out["searches"]] == ["glacier"]
    errors = [r["error"] for r in tool_results(chat.requests[1])]
    assert len(errors) == 4
    assert "invalid arguments" in errors[0]
    assert "query" in errors[1] and "Field required" in errors[1]
    assert "top_k" in errors[2]
    assert "unknown tool 'delete_everything'" in errors[3]


async def test_document_id_gives_the_model_the_document_and_the_kbs(stack, world, chat):
    """With document_id, the document's text is in the model's first request as the thing
    to work on; its searches still reach the KBs for context."""
    rt, _ = stack
    schema = {
        "type": "object",
        "properties": {"parties": {"type": "array", "items": {"type": "string"}}},
        "required": ["parties"],
    }
    chat.script(
        search("glacier meltwater"),
        Text(json.dumps({"parties": ["Acme Glaciology Ltd", "city water board"]})),
    )
    out = (
        await ask(
            rt,
            chat,
            document_id=world["docs"]["contract.txt"],
            instructions="Extract the parties of this agreement.",
            response_schema=schema,
            kb_ids=[world["science"]],
        )
    )["result"]
    assert out["answer"] == {"parties": ["Acme Glaciology Ltd", "city water board"]}
    user = message_text(chat.requests[0], "user")
    assert CONTRACT in user
    assert world["docs"]["contract.txt"] in user
    [result] = tool_results(chat.requests[1])
    assert "glaciers.md" in {r["source"] for r in result["results"]}


async def test_a_kb_scoped_caller_never_searches_outside_its_kbs(stack, world, chat):
    """With the key's scope limited to `science`, the model's searches for the secret
    return nothing from `private`; naming `private`, or its document, is not found."""
    rt, _ = stack
    scope = [world["science"]]
    query = search("vault combination espresso machine room", top_k=20)
    chat.script(query, Text("4-8-15-16"))
    unscoped = (await ask(rt, chat, question="What is the vault combination?"))["result"]
    assert world["private"] in {h["kb_id"] for h in unscoped["retrieved"]}  # it is findable

    chat.reset()
    chat.script(query, Text("no idea"))
    out = (await ask(rt, chat, question="What is the vault combination?", scope_kb_ids=scope))[
        "result"
    ]
    assert out["retrieved"]
    assert {h["kb_id"] for h in out["retrieved"]} == {world["science"]}
    assert SECRET not in json.dumps(chat.requests)
    assert "private" not in message_text(chat.requests[0], "system")

    denied = await ask(rt, chat, question="x", kb_ids=["private"], scope_kb_ids=scope)
    assert denied["error"]["error_type"] == "NotFound"
    hidden = await ask(
        rt, chat, document_id=world["docs"]["vault.txt"], question="x", scope_kb_ids=scope
    )
    assert hidden["error"]["error_type"] == "NotFound"
    assert len(chat.requests) == 2  # neither refused request reached the model


async def test_provider_errors_are_retried_then_classified(stack, world, chat):
    """A 503 is retried and succeeds; 503 on every one of a model call's tries is
    Unavailable; a 400 is not retried and is a validation error on `model`."""
    rt, _ = stack
    chat.script(Fail(503), Text("after a retry"))
    assert (await ask(rt, chat, question="q"))["result"]["answer"] == "after a retry"

    chat.reset()
    chat.script(*[Fail(503)] * MODEL_TRIES)
    error = (await ask(rt, chat, question="q"))["error"]
    assert error["error_type"] == "Unavailable"
    assert f"after {MODEL_TRIES} tries" in error["message"]
    assert len(chat.requests) == MODEL_TRIES

    chat.reset()
    chat.script(Fail(400, "context length exceeded"), Text("never sent"))
    error = (await ask(rt, chat, question="q"))["error"]
    assert (error["error_type"], error["field"]) == ("ValidationError", "model")
    assert len(chat.requests) == 1


async def test_a_model_is_required_and_must_be_routable(stack, world, chat):
    rt, _ = stack
    body = {"org_id": rt.settings.default_org, "question": "q"}
    missing = await rt.bus.request(Subject.SEARCH_ASK, AskRequest(**body), timeout=30)
    assert missing["error"]["field"] == "model"
    assert "KBMESH_ASK__MODEL" in missing["error"]["message"]
    unknown = await ask(rt, chat, question="q", model="no-such-provider-model")
    assert unknown["error"]["field"] == "model"
    assert not chat.requests


async def test_each_model_call_and_search_is_a_span_in_the_callers_trace(stack, world, chat):
    rt, _ = stack
    chat.script(search("glacier"), search("fjords"), Text("ok"))
    with trace.get_tracer("tests").start_as_current_span("caller") as root:
        out = (await ask(rt, chat, question="glaciers?"))["result"]
    assert out["iterations"] == 3
    in_trace = [
        s for s in EXPORTER.get_finished_spans() if s.context.trace_id == root.context.trace_id
    ]
    names = [s.name for s in in_trace]
    assert names.count("kbmesh.ask") == 1
    assert names.count("kbmesh.ask.model_call") == 3
    assert names.count("kbmesh.ask.search") == 2
    assert names.count("kbmesh.search") == 2
    calls = [s for s in in_trace if s.name == "kbmesh.ask.model_call"]
    assert all(s.attributes["gen_ai.usage.input_tokens"] > 0 for s in calls)


# ---- through the gateway: REST, stored prompts, MCP, /api/v1/tools --------------------------


def model(chat: ScriptedChat) -> dict[str, Any]:
    return {"model": MODEL, "api_base": chat.base_url}  # type: ignore[attr-defined]


async def test_rest_ask_answers_in_the_schema_with_citations(stack, world, chat):
    """POST /v1/ask: KBs by name, one search, a schema-following answer citing the espresso
    chunk, iterations 2."""
    _, client = stack
    chat.script(search("espresso grind size"), cite_source("espresso.md", "grind finer"))
    r = await client.post(
        "/v1/ask",
        headers=world["keys"]["admin"],
        json={
            "question": "How does grind size change a shot?",
            "kb_ids": ["science"],
            "response_schema": ANSWER_SCHEMA,
            **model(chat),
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["iterations"], out["stopped"]) == (2, "answered")
    assert out["answer"]["answer"] == "grind finer"
    [citation] = out["citations"]
    assert citation["document_id"] == world["docs"]["espresso.md"]
    assert out["usage"]["prompt_tokens"] > 0


async def test_rest_ask_invalid_twice_is_a_502_problem_with_the_reason(stack, world, chat):
    _, client = stack
    chat.script(Text("no JSON here"), Text("still no JSON"))
    r = await client.post(
        "/v1/ask",
        headers=world["keys"]["admin"],
        json={"question": "q", "response_schema": ANSWER_SCHEMA, **model(chat)},
    )
    assert r.status_code == 502, r.text
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert problem["error_type"] == "BadModelOutput"
    assert "not JSON" in problem["detail"] and "still no JSON" in problem["detail"]


async def test_rest_ask_rejects_bad_requests_before_any_model_call(stack, world, chat):
    _, client = stack
    h = world["keys"]["admin"]
    for body, field in [
        ({"question": "q", "response_schema": {"type": "nope"}}, "response_schema"),
        ({"question": "q", "max_iterations": 11}, "max_iterations"),
        ({"question": "q", "top_k": 0}, "top_k"),
        ({}, ""),
        ({"question": "q", "kb_ids": ["no-such-kb"]}, "kb_id"),
        ({"document_id": "no-such-document"}, "document_id"),
    ]:
        r = await client.post("/v1/ask", headers=h, json={**body, **model(chat)})
        assert r.status_code in (404, 422), (body, r.text)
        assert field in r.text, (body, r.text)
    assert not chat.requests


async def test_rest_ask_with_a_kb_scoped_key_stays_inside_its_kbs(stack, world, chat):
    """The scoped key's model searches `science` only; `private` and its document do not
    exist for it; the whole-org key reaches them."""
    _, client = stack
    h = world["keys"]["scoped"]
    chat.reset(
        default=lambda body: search("vault combination") if not tool_results(body) else Text("x")
    )
    r = await client.post("/v1/ask", headers=h, json={"question": "vault?", **model(chat)})
    assert r.status_code == 200, r.text
    assert {hit["kb_id"] for hit in r.json()["retrieved"]} == {world["science"]}
    assert SECRET not in json.dumps(chat.requests)
    for body in (
        {"question": "q", "kb_ids": ["private"]},
        {"document_id": world["docs"]["vault.txt"]},
    ):
        r = await client.post("/v1/ask", headers=h, json={**body, **model(chat)})
        assert r.status_code == 404, r.text
    r = await client.post(
        "/v1/ask",
        headers=world["keys"]["admin"],
        json={"question": "vault?", "kb_ids": ["private"], **model(chat)},
    )
    assert {hit["kb_id"] for hit in r.json()["retrieved"]} == {world["private"]}


async def test_stored_prompt_crud_and_run(stack, world, chat):
    """Create (KBs by name, stored as ids), list, get by id and by name, update, run on a
    document, delete; names are unique; read-only keys cannot write; a KB-scoped key does
    not see a prompt over a KB outside its scope."""
    _, client = stack
    admin, reader, scoped = (world["keys"][k] for k in ("admin", "reader", "scoped"))
    schema = {
        "type": "object",
        "properties": {"parties": {"type": "array", "items": {"type": "string"}}},
        "required": ["parties"],
    }
    body = {
        "name": "contract-parties",
        "instructions": "List the parties of the agreement.",
        "kb_ids": ["science"],
        "response_schema": schema,
        "max_iterations": 2,
        **model(chat),
    }
    r = await client.post("/v1/prompts", headers=admin, json=body)
    assert r.status_code == 201, r.text
    created = r.json()
    prompt_id = created["prompt_id"]
    assert created["kb_ids"] == [world["science"]]
    assert (await client.post("/v1/prompts", headers=admin, json=body)).status_code == 409
    assert (
        await client.post("/v1/prompts", headers=reader, json={**body, "name": "x"})
    ).status_code == 403
    secret = {**body, "name": "vault-reader", "kb_ids": ["private"]}
    assert (await client.post("/v1/prompts", headers=scoped, json=secret)).status_code == 404
    r = await client.post("/v1/prompts", headers=admin, json=secret)
    assert r.status_code == 201, r.text
    secret_id = r.json()["prompt_id"]

    listed = (await client.get("/v1/prompts", headers=admin)).json()
    assert {p["name"] for p in listed["items"]} >= {"contract-parties", "vault-reader"}
    scoped_names = {
        p["name"] for p in (await client.get("/v1/prompts", headers=scoped)).json()["items"]
    }
    assert "contract-parties" in scoped_names and "vault-reader" not in scoped_names
    assert (await client.get(f"/v1/prompts/{secret_id}", headers=scoped)).status_code == 404
    by_name = (await client.get("/v1/prompts/contract-parties", headers=reader)).json()
    assert by_name == (await client.get(f"/v1/prompts/{prompt_id}", headers=admin)).json()

    r = await client.patch(
        f"/v1/prompts/{prompt_id}", headers=admin, json={"max_iterations": 3, "instructions": None}
    )
    assert r.status_code == 200, r.text
    assert (r.json()["max_iterations"], r.json()["instructions"]) == (3, None)
    clash = await client.patch(
        f"/v1/prompts/{prompt_id}", headers=admin, json={"name": "vault-reader"}
    )
    assert clash.status_code == 409
    restored = await client.patch(
        f"/v1/prompts/{prompt_id}", headers=admin, json={"instructions": body["instructions"]}
    )
    assert restored.json()["instructions"] == body["instructions"]

    chat.script(
        search("glacier meltwater"),
        Text(json.dumps({"parties": ["Acme Glaciology Ltd", "city water board"]})),
    )
    r = await client.post(
        "/v1/prompts/contract-parties/run",
        headers=reader,
        json={"document_id": world["docs"]["contract.txt"]},
    )
    assert r.status_code == 200, r.text
    assert r.json()["answer"] == {"parties": ["Acme Glaciology Ltd", "city water board"]}
    first = chat.requests[0]
    assert CONTRACT in message_text(first, "user")
    assert body["instructions"] in message_text(first, "system")
    assert (
        await client.post(f"/v1/prompts/{prompt_id}/run", headers=admin, json={})
    ).status_code == 422

    assert (await client.delete(f"/v1/prompts/{prompt_id}", headers=reader)).status_code == 403
    r = await client.delete(f"/v1/prompts/{prompt_id}", headers=admin)
    assert r.json() == {"status": "deleted", "prompt_id": prompt_id}
    assert (await client.get(f"/v1/prompts/{prompt_id}", headers=admin)).status_code == 404
    assert (await client.delete(f"/v1/prompts/{secret_id}", headers=admin)).status_code == 200


async def test_kb_ask_over_mcp_and_the_tools_endpoint(stack, world, chat):
    """The official MCP client over streamable HTTP and POST /api/v1/tools/kb_ask: a cited
    schema answer, a stored prompt's run, the scoped key's limits and the 502 case."""
    rt, client = stack
    args = {
        "question": "How is a Raft leader elected?",
        "kb_ids": ["science"],
        "response_schema": ANSWER_SCHEMA,
        **model(chat),
    }
    prompt = {"name": "raft-explainer", "instructions": "Explain briefly.", **model(chat)}
    r = await client.post("/v1/prompts", headers=world["keys"]["admin"], json=prompt)
    assert r.status_code == 201, r.text

    async with http_session(rt.mcp_base, world["tokens"]["scoped"]) as session:
        chat.script(search("raft leader election"), cite_source("raft.md", "by vote"))
        out = ok(await session.call_tool("kb_ask", args))
        assert out["iterations"] == 2 and out["answer"]["answer"] == "by vote"
        assert [c["document_name"] for c in out["citations"]] == ["raft.md"]

        chat.reset()
        chat.script(search("raft"), Text("Leaders win a majority vote."))
        result = await session.call_tool(
            "kb_ask", {"prompt": "raft-explainer", "question": "How are leaders chosen?"}
        )
        assert ok(result)["answer"] == "Leaders win a majority vote."
        assert "Explain briefly." in message_text(chat.requests[0], "system")
        assert "Leaders win a majority vote." in result.content[0].text

        failed(await session.call_tool("kb_ask", {**args, "kb_ids": ["private"]}), "NotFound")
        chat.reset()
        chat.script(search("raft"), Text("{}"), Text("[]"))
        bad = failed(await session.call_tool("kb_ask", args), "BadModelOutput")
        assert "[] is not of type 'object'" in bad["message"]

    h = world["keys"]["scoped"]
    chat.reset()
    chat.script(search("raft leader election"), cite_source("raft.md", "by vote"))
    r = await client.post("/api/v1/tools/kb_ask", headers=h, json=args)
    assert r.status_code == 200, r.text
    assert [c["document_name"] for c in r.json()["citations"]] == ["raft.md"]
    chat.reset()
    chat.script(Text("nope"), Text("nope again"))
    r = await client.post("/api/v1/tools/kb_ask", headers=h, json=args)
    assert r.status_code == 502
    assert r.json()["error_type"] == "BadModelOutput" and "nope again" in r.json()["message"]
    r = await client.post(
        "/api/v1/tools/kb_ask",
        headers=h,
        json={"prompt": "raft-explainer", "question": "q", "max_iterations": 0},
    )
    assert r.status_code == 422 and r.json()["field"] == "max_iterations"


async def test_a_rest_answer_is_one_trace_from_the_gateway_to_every_model_call(stack, world, chat):
    """POST /v1/ask, the search.ask hop, each model call and each search share one trace."""
    _, client = stack
    chat.script(search("glacier"), Text("ok"))
    r = await client.post(
        "/v1/ask", headers=world["keys"]["admin"], json={"question": "glaciers?", **model(chat)}
    )
    assert r.status_code == 200, r.text
    spans = EXPORTER.get_finished_spans()
    request = next(s for s in spans if s.name == "POST /v1/ask")
    names = [s.name for s in spans if s.context.trace_id == request.context.trace_id]
    assert any("search.ask" in n for n in names), names
    assert names.count("kbmesh.ask.model_call") == 2
    assert names.count("kbmesh.ask.search") == 1 and names.count("kbmesh.search") == 1
