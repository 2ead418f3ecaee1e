"""The MCP tools over streamable HTTP, driven by the official MCP client against a real
in-process stack (nats-server, engine, model) behind a real uvicorn socket; and the same
tools as `POST /api/v1/tools/<name>`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from services.gateway.mcp import create_mcp
from services.gateway.tools import TOOLS
from tests.conftest import running_stack
from tests.support.asgi import serve_app
from tests.support.corpus import DOCS, PARAPHRASES
from tests.support.mcp_client import failed, http_session, ok, serve_http
from tests.support.openai_chat import (
    Reply,
    ScriptedChat,
    Text,
    message_text,
    search,
    tool_ids,
    tool_results,
)

CORE = {n for n, s in TOOLS.items() if "core" in s.toolsets}
COMPAT = {n for n, s in TOOLS.items() if "compat" in s.toolsets}


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    root = tmp_path_factory.mktemp("upload-root")
    async with (
        running_stack(
            tmp_path_factory.mktemp("mcp-http"),
            embedders=embedders,
            mcp_toolsets="core,compat",
            upload_root=root,
        ) as (rt, client),
        serve_http(rt) as (base, app),
    ):
        yield SimpleNamespace(rt=rt, client=client, base=base, app=app, root=root)


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def new_kb(session, **settings: Any) -> dict[str, Any]:
    return ok(await session.call_tool("kb_create", {"name": uid("kb"), **settings}))


async def upload(session, kb: str, name: str, content: str, **extra: Any) -> dict[str, Any]:
    body = ok(
        await session.call_tool(
            "kb_upload",
            {"kb": kb, "name": name, "content": content, "mime_type": "text/markdown", **extra},
        )
    )
    assert body["status"] == "complete" and body["chunk_count"] >= 1, body
    return body


async def search_ids(session, kb: str, query: str, **extra: Any) -> list[str]:
    body = ok(await session.call_tool("kb_search", {"kb": kb, "query": query, **extra}))
    return [h["document_id"] for h in body["hits"]]


# ---- listing --------------------------------------------------------------------------------


async def test_list_tools_shows_each_toolset_with_schemas(stack):
    """tools/list over HTTP offers every core and compat tool with an object input schema, an
    output schema, a description and annotations; the compat tools keep their callers' exact
    parameter names and defaults; KBMESH_MCP_TOOLSETS selects core, compat or both."""
    async with http_session(stack.base) as session:
        tools = {t.name: t for t in (await session.list_tools()).tools}
    assert set(tools) == CORE | COMPAT
    assert {"kb_delete", "kb_set_collection"} <= CORE & COMPAT
    for tool in tools.values():
        assert tool.input_schema["type"] == "object" and tool.output_schema["type"] == "object"
        assert len(tool.description or "") > 60, tool.name
        assert tool.annotations is not None
    props = tools["search_docs"].input_schema["properties"]
    assert set(props) == {"query", "projectId", "topK", "minScore"}
    assert (props["topK"]["default"], props["minScore"]["default"]) == (5, 0.5)
    assert set(tools["upload_document"].input_schema["required"]) == {
        "projectId",
        "fileName",
        "content",
    }
    assert tools["upload_document"].input_schema["properties"]["mimeType"]["default"] == (
        "text/plain"
    )
    assert set(tools["manageKnowledge"].input_schema["properties"]["operation"]["enum"]) == {
        "ingest",
        "search",
        "deleteBySource",
        "getChunk",
    }
    assert set(tools["search_knowledge_base"].input_schema["properties"]) == {
        "query",
        "top_k",
        "coalesce_neighbors",
        "metadata_filter",
        "upload_date_from",
        "upload_date_to",
    }
    assert tools["kb_search"].annotations.read_only_hint is True
    assert tools["kb_delete"].annotations.destructive_hint is True

    service = stack.app.state.service
    for toolsets, expected in (("core", CORE), ("compat", COMPAT), ("compat,core", CORE | COMPAT)):
        server = create_mcp(service, keys=stack.app.state.keys, toolsets=toolsets.split(","))
        assert {t.name for t in await server.list_tools()} == expected
    with pytest.raises(ValueError, match="KBMESH_MCP_TOOLSETS"):
        create_mcp(service, keys=stack.app.state.keys, toolsets=["core", "nope"])

    listing = (await stack.client.get("/api/v1/tools")).json()
    assert {t["name"] for t in listing["tools"]} == set(tools)
    by_name = {t["name"]: t for t in listing["tools"]}
    assert by_name["kb_search"]["input_schema"] == tools["kb_search"].input_schema
    assert by_name["kb_search"]["output_schema"] == tools["kb_search"].output_schema
    assert by_name["kb_delete"]["toolsets"] == ["core", "compat"]
    assert set(listing["error_schema"]["required"]) >= {"error_type", "message"}


async def test_mcp_endpoint_checks_the_host_header(stack):
    """/mcp answers without a redirect; DNS-rebinding protection serves loopback hosts with a
    port and refuses a foreign Host with 421."""
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    headers = {"Accept": "application/json, text/event-stream"}
    port = stack.base.rsplit(":", 1)[1]
    async with httpx.AsyncClient(timeout=30) as http:
        for host, status in (
            (f"127.0.0.1:{port}", 200),
            (f"localhost:{port}", 200),
            ("evil.example", 421),
        ):
            for path in ("/mcp", "/mcp/"):  # served as is: no redirect to follow
                r = await http.post(
                    f"{stack.base}{path}", json=init, headers={**headers, "Host": host}
                )
                assert r.status_code == status, (host, path, r.text[:200])


# ---- core tools -----------------------------------------------------------------------------


async def test_upload_then_search_and_get_chunk(stack):
    """kb_upload (content) makes documents searchable at once; kb_search finds each by a
    paraphrase with a numbered, attributed text; kb_get_chunk returns the hit with its
    neighbours."""
    async with http_session(stack.base) as session:
        kb = (await new_kb(session, chunk_size=50))["name"]
        ids = {
            name: (await upload(session, kb, name, text))["document_id"]
            for name, text in DOCS.items()
        }
        for name, query in PARAPHRASES.items():
            result = await session.call_tool("kb_search", {"kb": kb, "query": query})
            body = ok(result)
            assert body["hits"][0]["document_id"] == ids[name], (query, body["hits"])
            assert result.content[0].text.splitlines()[2].startswith(f"[1] {name}")
        long_doc = "\n\n".join(DOCS.values())
        whole = await upload(session, kb, "all.md", long_doc)
        body = ok(
            await session.call_tool(
                "kb_search",
                {
                    "kb": kb,
                    "query": PARAPHRASES["sourdough.md"],
                    "filters": {"document_ids": [whole["document_id"]]},
                },
            )
        )
        hit = body["hits"][0]
        assert hit["total_chunks"] > 1, hit
        chunk = ok(
            await session.call_tool(
                "kb_get_chunk", {"chunk_id": hit["chunk_id"], "kb": kb, "neighbors": 2}
            )
        )
        assert chunk["chunk"]["content"] == hit["content"]
        assert chunk["neighbors"] and {n["document_id"] for n in chunk["neighbors"]} == {
            hit["document_id"]
        }
        assert all(not n["is_matched"] for n in chunk["neighbors"])


async def test_update_document_and_collection_reach_search_filters(stack):
    """kb_update_document (tags, metadata) and kb_set_collection (set, then null) change what
    search filters and kb_list_documents see, without re-uploading."""
    async with http_session(stack.base) as session:
        kb = (await new_kb(session))["name"]
        volcano = (await upload(session, kb, "volcanoes.md", DOCS["volcanoes.md"]))["document_id"]
        bread = (await upload(session, kb, "sourdough.md", DOCS["sourdough.md"]))["document_id"]
        query = "mountains and bread"

        view = ok(
            await session.call_tool(
                "kb_update_document",
                {"document_id": volcano, "tags": ["geology"], "metadata": {"year": 2025}},
            )
        )
        # The KB's implicit kb:<id> tag is membership and stays.
        assert "geology" in view["tags"] and view["metadata"] == {"year": 2025}
        tagged = await search_ids(session, kb, query, filters={"tags": ["geology"]})
        assert set(tagged) == {volcano}
        by_meta = await search_ids(
            session, kb, query, filters={"metadata": [{"key": "year", "eq": 2025}]}
        )
        assert set(by_meta) == {volcano}

        set_ = ok(
            await session.call_tool(
                "kb_set_collection", {"document_id": bread, "collection": "kitchen"}
            )
        )
        assert set_["collection"] == "kitchen" and set_["title"] == "sourdough.md"
        assert set(await search_ids(session, kb, query, filters={"collection": "kitchen"})) == {
            bread
        }
        listed = ok(
            await session.call_tool("kb_list_documents", {"kb": kb, "collection": "kitchen"})
        )
        assert [d["document_id"] for d in listed["items"]] == [bread]

        cleared = ok(
            await session.call_tool("kb_set_collection", {"document_id": bread, "collection": None})
        )
        assert cleared["collection"] is None
        assert await search_ids(session, kb, query, filters={"collection": "kitchen"}) == []
        listed = ok(await session.call_tool("kb_list_documents", {"kb": kb}))
        assert {d["document_id"]: d["collection"] for d in listed["items"]} == {
            volcano: None,
            bread: None,
        }


async def test_knowledge_base_management_tools(stack):
    """kb_create, kb_list, kb_update, kb_stats and kb_reindex manage a knowledge base; each
    effect is visible through another tool."""
    async with http_session(stack.base) as session:
        created = await new_kb(session, description="first", tag_ids=["manuals"])
        kb = created["name"]
        listed = ok(await session.call_tool("kb_list", {"name_search": kb}))
        assert [k["kb_id"] for k in listed["items"]] == [created["kb_id"]]

        # Membership by tag: an upload into the default KB tagged "manuals" joins kb too.
        doc = ok(
            await session.call_tool(
                "kb_upload", {"name": "tcp.md", "content": DOCS["tcp.md"], "tags": ["manuals"]}
            )
        )
        assert created["kb_id"] in doc["kb_ids"]
        stats = ok(await session.call_tool("kb_stats", {"kb": kb}))
        assert stats["document_count"] == 1 and stats["chunk_count"] >= 1

        updated = ok(await session.call_tool("kb_update", {"kb": kb, "description": "second"}))
        assert updated["description"] == "second" and updated["settings_version"] == 1
        listed = ok(await session.call_tool("kb_list", {"name_search": kb}))
        assert listed["items"][0]["description"] == "second"

        ack = ok(await session.call_tool("kb_reindex", {"kb": kb}))
        assert ack == {"status": "reindexing", "kb_id": created["kb_id"], "documents": 1}
        after = ok(await session.call_tool("kb_list", {"name_search": kb}))["items"][0]
        assert after["settings_version"] == 2
        ok(await session.call_tool("kb_delete", {"document_id": doc["document_id"]}))


async def test_delete_and_delete_source(stack):
    """kb_delete removes a document from search at once and reports its title; deleting it
    again gives deleted_count 0; kb_delete_source removes every document of a source."""
    async with http_session(stack.base) as session:
        kb = (await new_kb(session))["name"]
        source = uid("repo")
        ids = {
            name: (await upload(session, kb, name, text, source_id=source))["document_id"]
            for name, text in DOCS.items()
        }
        volcano = ids["volcanoes.md"]
        gone = ok(await session.call_tool("kb_delete", {"document_id": volcano}))
        assert gone["status"] == "deleted" and gone["deleted_count"] == 1
        assert (gone["document_id"], gone["title"]) == (volcano, "volcanoes.md")
        assert volcano not in await search_ids(session, kb, PARAPHRASES["volcanoes.md"])
        again = ok(await session.call_tool("kb_delete", {"document_id": volcano}))
        assert again["deleted_count"] == 0 and again["status"] == "not_found"

        dropped = ok(await session.call_tool("kb_delete_source", {"source_id": source}))
        assert dropped["deleted_count"] == 2
        assert set(dropped["document_ids"]) == {ids["sourdough.md"], ids["tcp.md"]}
        left = ok(await session.call_tool("kb_list_documents", {"kb": kb}))
        assert left["total"] == 0
        r = await stack.client.get(f"/v1/documents/{ids['tcp.md']}")
        assert r.status_code == 404


# ---- compat tools ---------------------------------------------------------------------------


async def test_compat_upload_search_and_delete_document(stack):
    """upload_document (plain and base64) → search_docs finds it with title and score; an
    unknown project is 'project not found'; delete_document works by file name and by id."""
    async with http_session(stack.base) as session:
        project = (await new_kb(session))["kb_id"]
        plain = ok(
            await session.call_tool(
                "upload_document",
                {
                    "projectId": project,
                    "fileName": "docs/volcanoes.md",
                    "content": DOCS["volcanoes.md"],
                    "mimeType": "text/markdown",
                },
            )
        )
        assert plain["status"] == "complete" and plain["chunkCount"] >= 1
        assert plain["fileName"] == "docs/volcanoes.md"
        encoded = base64.b64encode(DOCS["sourdough.md"].encode()).decode()
        b64 = ok(
            await session.call_tool(
                "upload_document",
                {"projectId": project, "fileName": "sourdough.md", "content": encoded},
            )
        )
        assert b64["status"] == "complete"

        result = await session.call_tool(
            "search_docs",
            {"query": PARAPHRASES["sourdough.md"], "projectId": project, "minScore": 0.1},
        )
        found = ok(result)["results"]
        assert found[0]["documentTitle"] == "sourdough.md"
        assert found[0]["content"].startswith("# Baking sourdough")  # decoded, not base64
        assert set(found[0]) == {"content", "documentTitle", "chunkIndex", "score"}
        assert result.content[0].text.startswith("1. sourdough.md (chunk 0, score ")

        missing = failed(
            await session.call_tool("search_docs", {"query": "x", "projectId": "no-such-project"}),
            "NotFound",
        )
        assert "project 'no-such-project' not found" in missing["message"]

        by_path = ok(await session.call_tool("delete_document", {"filepath": "docs/volcanoes.md"}))
        assert by_path["deleted_count"] == 1 and by_path["document_id"] == plain["documentId"]
        by_id = ok(await session.call_tool("delete_document", {"filepath": b64["documentId"]}))
        assert by_id["deleted_count"] == 1
        none = ok(await session.call_tool("delete_document", {"filepath": "docs/volcanoes.md"}))
        assert none["deleted_count"] == 0 and none["message"]
        after = ok(
            await session.call_tool(
                "search_docs",
                {"query": PARAPHRASES["sourdough.md"], "projectId": project, "minScore": 0.0},
            )
        )
        assert after["results"] == []


async def test_compat_manage_knowledge_operations(stack):
    """manageKnowledge: ingest (re-ingesting a uri replaces it), search returns
    {chunks, totalMatches}, getChunk fetches an ingested chunk id, deleteBySource removes the
    source's documents."""
    source = uid("git")
    uri = f"https://git.example/{source}/docs/tcp.md"
    async with http_session(stack.base) as session:
        first = ok(
            await session.call_tool(
                "manageKnowledge",
                {
                    "operation": "ingest",
                    "content": DOCS["tcp.md"],
                    "uri": uri,
                    "sourceId": source,
                    "metadata": {"team": "net"},
                },
            )
        )
        assert first["success"] and first["chunksCreated"] >= 1
        again = ok(
            await session.call_tool(
                "manageKnowledge",
                {
                    "operation": "ingest",
                    "content": DOCS["tcp.md"] + "\n\nCUBIC is the default.",
                    "uri": uri,
                    "sourceId": source,
                },
            )
        )
        assert again["documentId"] == first["documentId"]

        found = ok(
            await session.call_tool(
                "manageKnowledge",
                {"operation": "search", "query": PARAPHRASES["tcp.md"], "limit": 10},
            )
        )
        assert found["totalMatches"] >= len(found["chunks"]) >= 1
        # Other KBs of the org hold the same TCP text: the ingested copy is among the best.
        top = next(c for c in found["chunks"] if c.get("uri") == uri)
        assert top["sourceId"] == source
        assert {"id", "content", "score", "matchType", "sourceId", "uri", "metadata"} <= set(top)

        chunk = ok(
            await session.call_tool(
                "manageKnowledge", {"operation": "getChunk", "chunkId": again["chunkIds"][0]}
            )
        )
        assert chunk["chunk"]["uri"] == uri and chunk["chunk"]["chunkIndex"] == 0

        deleted = ok(
            await session.call_tool(
                "manageKnowledge", {"operation": "deleteBySource", "sourceId": source}
            )
        )
        assert deleted["deletedCount"] == 1
        found = ok(
            await session.call_tool(
                "manageKnowledge", {"operation": "search", "query": PARAPHRASES["tcp.md"]}
            )
        )
        assert all(c.get("sourceId") != source for c in found["chunks"])

        needs = failed(
            await session.call_tool("manageKnowledge", {"operation": "search"}), "ValidationError"
        )
        assert "query is required" in needs["message"]
        failed(
            await session.call_tool("manageKnowledge", {"operation": "deleteBySource"}),
            "ValidationError",
        )


async def test_compat_search_knowledge_base_with_filters_and_neighbours(stack):
    """search_knowledge_base filters by document name and tags and coalesces neighbours:
    results carry source, relevance, is_matched and chunk_index."""
    async with http_session(stack.base) as session:
        kb = (await new_kb(session, chunk_size=50))["name"]
        name = f"{uid('volcano')}.md"
        tag = uid("tag")
        await upload(session, kb, name, DOCS["volcanoes.md"], tags=[tag])
        await upload(session, kb, "sourdough.md", DOCS["sourdough.md"], tags=[tag])
        body = ok(
            await session.call_tool(
                "search_knowledge_base",
                {
                    "query": PARAPHRASES["volcanoes.md"],
                    "top_k": 1,
                    "coalesce_neighbors": 1,
                    "metadata_filter": {"document_name": name, "tag_ids": [tag]},
                    "upload_date_from": "2000-01-01T00:00:00Z",
                },
            )
        )
        assert body["query"] == PARAPHRASES["volcanoes.md"]
        assert body["coalesced"] == 1 and body["sources_searched"] >= 1
        assert {r["source"] for r in body["results"]} == {name}
        matched = [r for r in body["results"] if r["is_matched"]]
        context = [r for r in body["results"] if not r["is_matched"]]
        assert len(matched) == 1 and matched[0]["relevance"] > 0 and context
        assert all(r["relevance"] is None for r in context)
        future = ok(
            await session.call_tool(
                "search_knowledge_base",
                {"query": "volcano", "upload_date_from": "2999-01-01T00:00:00Z"},
            )
        )
        assert future["results"] == []


# ---- REST parity ----------------------------------------------------------------------------


def answer_from_first_hit(body: dict[str, Any]) -> Reply:
    """A scripted chat model: one search for the question, then an answer citing the top hit."""
    if not tool_results(body):
        return search(message_text(body, "user"))
    return Text(f"See {tool_ids(body)[0]}.")


async def test_rest_tools_answer_like_mcp_for_every_tool(stack):
    """POST /api/v1/tools/<name> takes the same arguments and returns the same JSON as the MCP
    call's structured result, for every tool (fields that must differ between two real
    mutations, like new ids and timestamps, excepted) and for errors."""
    seen: set[str] = set()

    async def both(
        name: str,
        args: dict[str, Any],
        rest_args: dict[str, Any] | None = None,
        volatile: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        seen.add(name)
        via_mcp = ok(await session.call_tool(name, args))
        r = await stack.client.post(f"/api/v1/tools/{name}", json=rest_args or args)
        assert r.status_code == 200, r.text
        via_rest = r.json()
        assert set(via_mcp) == set(via_rest), name
        strip = lambda d: {k: v for k, v in d.items() if k not in volatile}  # noqa: E731
        assert strip(via_mcp) == strip(via_rest), name
        return via_mcp

    async with http_session(stack.base) as session:
        made = await both(
            "kb_create",
            {"name": uid("kb"), "chunk_size": 60},
            {"name": uid("kb"), "chunk_size": 60},
            volatile=("kb_id", "name", "created_at", "updated_at"),
        )
        kb = made["name"]
        source_a, source_b = uid("src"), uid("src")
        # The REST twins differ by a word, so no two chunks tie in a ranking.
        name = f"{uid('tcp')}.md"
        args = {"kb": kb, "name": name}
        up = await both(
            "kb_upload",
            {**args, "content": DOCS["tcp.md"], "source_id": source_a},
            {**args, "content": DOCS["tcp.md"].replace("CUBIC", "BBR"), "source_id": source_b},
            volatile=("document_id",),
        )
        doc = up["document_id"]
        volcano = {"projectId": kb, "fileName": "volcanoes.md", "content": DOCS["volcanoes.md"]}
        await both(
            "upload_document",
            volcano,
            {**volcano, "content": DOCS["volcanoes.md"].replace("Sicily", "Italy")},
            volatile=("documentId",),
        )
        hits = await both(
            "kb_search", {"kb": kb, "query": PARAPHRASES["tcp.md"], "coalesce_neighbors": 1}
        )
        chunk_id = hits["hits"][0]["chunk_id"]
        await both("kb_get_chunk", {"chunk_id": chunk_id, "neighbors": 1})
        chat = ScriptedChat(default=answer_from_first_hit)
        # The chat server listens on loopback: allowed for this call only.
        with allowlist(stack.rt.settings, ["127.0.0.1/32"]):
            async with serve_app(chat.app, lifespan="off") as chat_url:
                await both(
                    "kb_ask",
                    {
                        "question": PARAPHRASES["tcp.md"],
                        "kb_ids": [kb],
                        "model": "hosted_vllm/scripted",
                        "api_base": chat_url + "/v1",
                    },
                )
        await both("manageKnowledge", {"operation": "getChunk", "chunkId": chunk_id})
        await both(
            "search_docs", {"query": PARAPHRASES["tcp.md"], "projectId": kb, "minScore": 0.1}
        )
        await both(
            "search_knowledge_base",
            {
                "query": PARAPHRASES["tcp.md"],
                "top_k": 3,
                "metadata_filter": {"document_name": name},
            },
        )
        await both(
            "kb_update_document",
            {"document_id": doc, "tags": ["t1"], "metadata": {"k": "v"}},
            volatile=("updated_at",),
        )
        await both("kb_set_collection", {"document_id": doc, "collection": "c1"})
        await both("kb_list_documents", {"kb": kb})
        await both("kb_list", {"name_search": kb})
        await both("kb_stats", {"kb": kb})
        await both("kb_update", {"kb": kb, "description": "d"}, volatile=("updated_at",))
        await both("kb_reindex", {"kb": kb, "failed_only": True})
        await both(
            "kb_delete", {"document_id": uid("missing")}, volatile=("document_id", "message")
        )
        await both(
            "kb_delete_source",
            {"source_id": source_a},
            {"source_id": source_b},
            volatile=("source_id", "document_ids", "message"),
        )
        # A source each way (a public address, written as one: nothing is resolved), then
        # the same calls on one of them.
        site = {"kind": "web", "kb": kb, "url": "https://93.184.215.14/docs/"}
        mine, twin = uid("site"), uid("site")
        await both(
            "kb_source_add",
            {**site, "source_id": mine},
            {**site, "source_id": twin},
            volatile=("source_id", "hook_path", "webhook_secret", "created_at", "updated_at"),
        )
        await both("kb_source_list", {"kb": kb})
        await both("kb_source_get", {"source": mine})
        await both("kb_source_update", {"source": mine, "schedule": "2h"}, volatile=("updated_at",))
        await both("kb_source_sync", {"source": mine})
        await both("kb_source_remove", {"source": mine}, {"source": twin}, volatile=("source_id",))
        # The same file name again replaced the document: the REST twin deletes another.
        ok(await session.call_tool("upload_document", {**volcano, "fileName": "volcanoes-2.md"}))
        await both(
            "delete_document",
            {"filepath": "volcanoes.md"},
            {"filepath": "volcanoes-2.md"},
            volatile=("document_id", "message", "title"),
        )
        await both("delete_document", {"filepath": uid("nothing")}, volatile=("message",))

        bad = {"query": "x", "top_k": "many"}
        via_mcp = failed(await session.call_tool("kb_search", bad), "ValidationError")
        r = await stack.client.post("/api/v1/tools/kb_search", json=bad)
        assert r.status_code == 422 and r.json() == via_mcp
        r = await stack.client.post("/api/v1/tools/no_such_tool", json={})
        assert r.status_code == 404 and r.json()["error_type"] == "NotFound"
        r = await stack.client.post(
            "/api/v1/tools/kb_list", content=b"[1, 2]", headers={"content-type": "application/json"}
        )
        assert r.status_code == 422 and r.json()["status"] == "error"
    assert seen == CORE | COMPAT


# ---- ingest by URL and by path --------------------------------------------------------------


async def _page(request: Request) -> Response:
    return Response(
        "<!DOCTYPE html><html><body><h1>Tide pools</h1><p>Tide pools hold "
        "anemones, crabs and sea stars between the tides.</p></body></html>",
        media_type="application/octet-stream",
    )


async def _huge(request: Request) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        for _ in range(11):
            yield b"x" * (1024 * 1024)

    return StreamingResponse(body(), media_type="text/plain")


async def _doc(request: Request) -> PlainTextResponse:
    return PlainTextResponse(DOCS["volcanoes.md"], media_type="text/markdown")


async def _drip(request: Request) -> StreamingResponse:
    """40 bytes, one every 0.2 s: each read is quick, the whole body slow."""

    async def body() -> AsyncIterator[bytes]:
        for _ in range(40):
            yield b"x"
            await asyncio.sleep(0.2)

    return StreamingResponse(body(), media_type="text/plain")


async def _moved(request: Request) -> Response:
    return Response(status_code=302, headers={"location": "/volcanoes.md"})


@contextlib.asynccontextmanager
async def loopback_site() -> AsyncIterator[str]:
    app = Starlette(
        routes=[
            Route("/volcanoes.md", _doc),
            Route("/page", _page),
            Route("/huge.txt", _huge),
            Route("/moved", _moved),
            Route("/drip.txt", _drip),
        ]
    )
    async with serve_app(app, lifespan="off") as base:
        yield base


@contextlib.contextmanager
def allowlist(settings, entries: list[str]) -> Iterator[None]:
    """The gateway reads KBMESH_EGRESS__ALLOWLIST per call; restored so later tests see none."""
    before = settings.egress.allowlist
    settings.egress.allowlist = entries
    try:
        yield
    finally:
        settings.egress.allowlist = before


async def test_url_ingest_from_allowlisted_loopback_and_refused_without(stack):
    """kb_upload by url fetches from an allow-listed loopback server (type from Content-Type,
    redirects followed, HTML sniffed from octet-stream by ingest: without wait the answer
    says no type yet) and the result is searchable; without
    the allow-list the same URL is refused before any request, as are private, link-local and
    non-http URLs; a host-name entry allows only that name; a body over the size limit is cut
    off while streaming."""
    async with loopback_site() as site, http_session(stack.base) as session:
        kb = (await new_kb(session))["name"]
        url = f"{site}/volcanoes.md"
        refused = failed(await session.call_tool("kb_upload", {"kb": kb, "url": url}), "Forbidden")
        assert (
            "127.0.0.1" in refused["message"] and "KBMESH_EGRESS__ALLOWLIST" in refused["message"]
        )
        with allowlist(stack.rt.settings, ["127.0.0.1/32"]):
            got = ok(await session.call_tool("kb_upload", {"kb": kb, "url": url}))
            moved = ok(
                await session.call_tool(
                    "kb_upload", {"kb": kb, "url": f"{site}/moved", "name": "moved.md"}
                )
            )
            page = ok(await session.call_tool("kb_upload", {"kb": kb, "url": f"{site}/page"}))
            # Without wait the answer comes before ingest has read the type (none declared).
            other = (await new_kb(session))["name"]
            early = ok(
                await session.call_tool(
                    "kb_upload", {"kb": other, "url": f"{site}/page", "wait": False}
                )
            )
            huge = failed(
                await session.call_tool("kb_upload", {"kb": kb, "url": f"{site}/huge.txt"}),
                "ContentTooLarge",
            )
        assert (got["status"], got["name"], got["mime_type"]) == (
            "complete",
            "volcanoes.md",
            "text/markdown",
        )
        assert moved["status"] == "complete" and moved["mime_type"] == "text/markdown"
        assert page["status"] == "complete" and page["mime_type"] == "text/html"
        assert early["status"] == "processing" and early["mime_type"] is None, early
        assert "10 MB" in huge["message"]
        hits = ok(
            await session.call_tool(
                "kb_search", {"kb": kb, "query": "sea creatures left behind by the tide"}
            )
        )["hits"]
        assert hits[0]["document_id"] == page["document_id"]
        hits = ok(
            await session.call_tool(
                "kb_search",
                {
                    "kb": kb,
                    "query": PARAPHRASES["volcanoes.md"],
                    "filters": {"document_ids": [got["document_id"]]},
                },
            )
        )["hits"]
        assert hits and hits[0]["uri"] == url
        again = failed(await session.call_tool("kb_upload", {"kb": kb, "url": url}), "Forbidden")
        assert again == refused
        # A host-name entry allows that name only, whichever loopback address answers.
        by_name = url.replace("127.0.0.1", "localhost")
        with allowlist(stack.rt.settings, ["localhost"]):
            named = ok(await session.call_tool("kb_upload", {"kb": kb, "url": by_name}))
            failed(await session.call_tool("kb_upload", {"kb": kb, "url": url}), "Forbidden")
        assert named["status"] == "complete"
        for private in (
            "http://10.1.2.3/x",
            "http://169.254.169.254/latest/meta-data",
            "http://[::1]:9/x",
            "http://localhost:9/x",
        ):
            failed(await session.call_tool("kb_upload", {"kb": kb, "url": private}), "Forbidden")
        failed(
            await session.call_tool("kb_upload", {"kb": kb, "url": "file:///etc/passwd"}),
            "ValidationError",
        )


async def test_a_dripped_body_is_cut_off_at_the_total_fetch_deadline(stack):
    """A server that sends each byte well within the read timeout but the whole body past
    KBMESH_LIMITS__FETCH_TOTAL_SECONDS is refused with an error naming the deadline, and no
    document is stored."""
    limits = stack.rt.settings.limits
    async with loopback_site() as site, http_session(stack.base) as session:
        kb = (await new_kb(session))["name"]
        before = limits.fetch_total_seconds
        limits.fetch_total_seconds = 1.0
        try:
            with allowlist(stack.rt.settings, ["127.0.0.1/32"]):
                started = asyncio.get_running_loop().time()
                refused = failed(
                    await session.call_tool("kb_upload", {"kb": kb, "url": f"{site}/drip.txt"}),
                    "FetchError",
                )
                elapsed = asyncio.get_running_loop().time() - started
        finally:
            limits.fetch_total_seconds = before
        assert "longer than 1 s" in refused["message"]
        assert "KBMESH_LIMITS__FETCH_TOTAL_SECONDS" in refused["message"]
        assert refused["field"] == "url"
        # The body takes 8 s to drip; the refusal comes well before it would have finished.
        assert elapsed < 7.5
        listed = ok(await session.call_tool("kb_list_documents", {"kb": kb}))
        assert listed["total"] == 0


async def test_path_ingest_only_under_the_upload_root(stack, tmp_path):
    """kb_upload by path reads files under KBMESH_UPLOAD_ROOT; paths outside it — '..',
    absolute, or a symlink inside the root pointing out — are refused without reading."""
    root = stack.root
    (root / "guides").mkdir(exist_ok=True)
    (root / "guides" / "bread.md").write_text(DOCS["sourdough.md"])
    secret = tmp_path / "secret.md"
    secret.write_text("the launch code is 0000")
    link = root / f"{uid('link')}.md"
    link.symlink_to(secret)
    async with http_session(stack.base) as session:
        kb = (await new_kb(session))["name"]
        got = ok(await session.call_tool("kb_upload", {"kb": kb, "path": "guides/bread.md"}))
        assert (got["status"], got["name"], got["mime_type"]) == (
            "complete",
            "bread.md",
            "text/markdown",
        )
        assert got["document_id"] in await search_ids(session, kb, PARAPHRASES["sourdough.md"])
        for outside in (
            f"../{secret.parent.name}/secret.md",
            str(secret),
            link.name,
            str(link),
            "guides/../../secret.md",
        ):
            body = failed(
                await session.call_tool("kb_upload", {"kb": kb, "path": outside}), "Forbidden"
            )
            assert "outside the upload root" in body["message"], outside
        failed(
            await session.call_tool("kb_upload", {"kb": kb, "path": "guides/nope.md"}), "NotFound"
        )
        failed(
            await session.call_tool("kb_upload", {"kb": kb, "path": "guides"}), "ValidationError"
        )
        assert await search_ids(session, kb, "launch code") == [got["document_id"]]


# ---- bad input ------------------------------------------------------------------------------


async def test_bad_input_gives_structured_errors_and_the_server_keeps_serving(stack):
    """Wrong types, missing and unknown fields, over-size content, empty ids, bad base64 and
    unknown tools each come back as {status: error, error_type, message} with isError and no
    traceback; nothing is stored, and the same session keeps working."""
    before = len(await stack.rt.registries.documents.list())
    big = "x" * (10 * 1024 * 1024 + 1)
    cases = [
        ("kb_search", {"query": "x", "top_k": "many"}, "ValidationError", "top_k"),
        ("kb_search", {"top_k": 3}, "ValidationError", "query"),
        ("kb_search", {"query": "x", "bogus": 1}, "ValidationError", "bogus"),
        ("kb_search", {"query": "x", "kb": "no-such-kb"}, "NotFound", "kb"),
        ("kb_upload", {"name": "a", "content": big}, "ContentTooLarge", "content"),
        (
            "kb_upload",
            {"name": "a", "content": "x", "url": "http://example.com/"},
            "ValidationError",
            None,
        ),
        (
            "kb_upload",
            {"name": "a", "content": "!!!", "content_encoding": "base64"},
            "ValidationError",
            "content",
        ),
        (
            "kb_upload",
            {"name": "a", "content": "x", "mime_type": "audio/mpeg"},
            "ValidationError",
            "mime_type",
        ),
        (
            "upload_document",
            {"projectId": "default", "fileName": "big.txt", "content": big},
            "ContentTooLarge",
            "content",
        ),
        (
            "upload_document",
            {"projectId": "default", "fileName": "a.txt"},
            "ValidationError",
            "content",
        ),
        ("delete_document", {"filepath": ""}, "ValidationError", "filepath"),
        ("delete_document", {"filepath": "   "}, "ValidationError", "filepath"),
        ("kb_delete", {"document_id": ""}, "ValidationError", "document_id"),
        ("kb_delete", {}, "ValidationError", "document_id"),
        ("kb_set_collection", {"document_id": "nope"}, "ValidationError", "collection"),
        (
            "kb_get_chunk",
            {"chunk_id": str(uuid.uuid4()), "neighbors": 9},
            "ValidationError",
            "neighbors",
        ),
        ("kb_get_chunk", {"chunk_id": "abc-123"}, "ValidationError", "chunk_id"),
        ("kb_create", {"name": "x", "chunk_size": 5000}, "ValidationError", "chunk_size"),
        ("no_such_tool", {}, "NotFound", "name"),
    ]
    async with http_session(stack.base) as session:
        for name, args, error_type, field in cases:
            result = await session.call_tool(name, args)
            body = failed(result, error_type)
            assert body.get("field") == field, (name, body)
            assert result.content[0].text.startswith(f"Error ({error_type})"), name
        assert (
            "10 MB"
            in failed(
                await session.call_tool(
                    "upload_document",
                    {"projectId": "default", "fileName": "big.txt", "content": big},
                )
            )["message"]
        )
        assert len((await session.list_tools()).tools) == len(CORE | COMPAT)
        ok(await session.call_tool("kb_list", {}))
    assert len(await stack.rt.registries.documents.list()) == before
