"""The agent surface as strict clients see it: every test runs with the official Python MCP
client over streamable HTTP and over stdio (`kbmesh mcp` connected to the same stack), and
the failure shape is also read by the official TypeScript SDK, which validates structured
content against each tool's output schema even on errors."""

from __future__ import annotations

import base64
import json
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from services.common.domain.content import SUPPORTED
from tests.conftest import running_stack
from tests.support.bus import bus_env
from tests.support.mcp_client import (
    ERROR_META,
    TRANSPORTS,
    failed,
    held,
    kbmesh_command,
    ok,
    serve_http,
    session_over,
    ts_call_tool,
    ts_sdk_missing,
)


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    root = tmp_path_factory.mktemp("upload-root")
    async with (
        running_stack(
            tmp_path_factory.mktemp("agent-surface"),
            embedders=embedders,
            mcp_toolsets="core,compat",
            upload_root=root,
        ) as (rt, client),
        serve_http(rt) as (base, _),
    ):
        yield SimpleNamespace(rt=rt, client=client, base=base, root=root)


@pytest.fixture(scope="module", params=TRANSPORTS)
async def mcp(request, stack, tmp_path_factory):
    """One client session per transport, shared by the module's tests."""
    data_dir = tmp_path_factory.mktemp(f"client-{request.param}")
    async with held(session_over(request.param, stack.rt, stack.base, data_dir)) as session:
        yield session


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def new_kb(stack) -> dict[str, Any]:
    r = await stack.client.post("/v1/kbs", json={"name": uid("kb")})
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


async def tools(mcp) -> dict[str, Any]:
    return {t.name: t for t in (await mcp.list_tools()).tools}


# ---- errors ---------------------------------------------------------------------------------


async def test_a_failing_tool_answers_with_its_message_as_text_and_no_structured_content(mcp):
    """A tool error is text content flagged isError with no structured content (which strict
    clients would check against the output schema, e.g. search_docs' required `results`);
    the message names what is wrong, and `_meta` carries error_type and the parameter."""
    result = await mcp.call_tool("search_docs", {"query": "x", "projectId": "no-such-project"})
    assert result.is_error and result.structured_content is None
    assert "project 'no-such-project' not found" in result.content[0].text
    error = result.meta[ERROR_META]
    assert error["error_type"] == "NotFound" and error["field"] == "projectId"


@pytest.mark.parametrize(
    ("tool", "arguments", "field"),
    [
        ("kb_search", {"query": "x", "kb": "no-such-kb"}, "kb"),
        ("kb_stats", {"kb": "no-such-kb"}, "kb"),
        (
            "upload_document",
            {"projectId": "nope", "fileName": "a.txt", "content": "x"},
            "projectId",
        ),
        ("manageKnowledge", {"operation": "getChunk", "chunkId": str(uuid.uuid4())}, "chunkId"),
        ("kb_get_chunk", {"chunk_id": str(uuid.uuid4())}, "chunk_id"),
    ],
)
async def test_errors_name_the_parameter_the_caller_sent(mcp, tool, arguments, field):
    """An error's `field` is the caller's parameter name (`kb`, `projectId`, `chunkId`), not
    the name the service uses inside (`kb_id`, `chunk_id`)."""
    assert failed(await mcp.call_tool(tool, arguments), "NotFound")["field"] == field


async def test_search_docs_holds_arguments_to_its_schema(mcp):
    """search_docs refuses a string where an integer is declared (`topK: "5"`), an unknown
    argument, and a minScore outside 0-1, naming the parameter each time."""
    base = {"query": "x", "projectId": "default"}
    for extra, field in (
        ({"topK": "5"}, "topK"),
        ({"topk": 5}, "topk"),
        ({"minScore": 1.5}, "minScore"),
        ({"minScore": -0.1}, "minScore"),
    ):
        body = failed(await mcp.call_tool("search_docs", {**base, **extra}), "ValidationError")
        assert body["field"] == field, (extra, body)
    ok(await mcp.call_tool("search_docs", {**base, "topK": 5, "minScore": 0.0}))


async def test_kb_search_bounds_min_score(mcp):
    for score in (1.01, -1.01):
        body = failed(await mcp.call_tool("kb_search", {"query": "x", "min_score": score}))
        assert body["field"] == "min_score"


async def test_unreadable_content_is_refused_and_empty_content_stores_nothing(stack, mcp):
    """A PDF that is no PDF, through kb_upload with wait, is a tool error naming `content`
    (not a 'failed' result); its document is listed as `failed` with the reason, holding
    nothing. Whitespace-only text is refused before anything is published and leaves no
    document behind."""
    name = uid("broken") + ".pdf"
    bad_pdf = base64.b64encode(b"%PDF-1.4 this is not really a pdf").decode()
    body = failed(
        await mcp.call_tool(
            "kb_upload",
            {
                "name": name,
                "content": bad_pdf,
                "content_encoding": "base64",
                "mime_type": "application/pdf",
            },
        ),
        "ValidationError",
    )
    assert body["field"] == "content" and "PDF" in body["message"], body
    blank = uid("blank") + ".md"
    body = failed(
        await mcp.call_tool("kb_upload", {"name": blank, "content": "  \n\t \n"}),
        "ValidationError",
    )
    assert body["field"] == "content", body
    listed = ok(await mcp.call_tool("kb_list_documents", {"name_search": name[:12]}))
    assert [(d["status"], d["size_bytes"]) for d in listed["items"]] == [("failed", 0)]
    assert "PDF" in listed["items"][0]["error"]
    listed = ok(await mcp.call_tool("kb_list_documents", {"name_search": blank[:11]}))
    assert listed["total"] == 0


# ---- documents by uri and file name ----------------------------------------------------------


async def test_delete_document_by_a_shared_uri_deletes_nothing_and_lists_the_matches(stack, mcp):
    """Two documents uploaded with the same uri: delete_document by that uri is a Conflict
    listing both ids, and both documents remain; by id it deletes the one named."""
    kb = await new_kb(stack)
    uri = f"https://example.com/{uid('shared')}.md"
    ids = [
        ok(
            await mcp.call_tool(
                "kb_upload",
                {"kb": kb["kb_id"], "name": f"copy-{i}.md", "content": f"copy {i}", "uri": uri},
            )
        )["document_id"]
        for i in range(2)
    ]
    body = failed(await mcp.call_tool("delete_document", {"filepath": uri}), "Conflict")
    assert body["field"] == "filepath" and all(i in body["message"] for i in ids), body
    for document_id in ids:
        assert (await stack.client.get(f"/v1/documents/{document_id}")).status_code == 200
    gone = ok(await mcp.call_tool("delete_document", {"filepath": ids[0]}))
    assert gone["deleted_count"] == 1 and gone["document_id"] == ids[0]


async def test_uploading_the_same_file_name_into_a_project_replaces_it(stack, mcp):
    """upload_document twice with one fileName into one project keeps one document (the
    same id, a new revision) whose text is the second upload's."""
    kb = await new_kb(stack)
    first = ok(
        await mcp.call_tool(
            "upload_document",
            {"projectId": kb["kb_id"], "fileName": "notes.txt", "content": "the tide is high"},
        )
    )
    second = ok(
        await mcp.call_tool(
            "upload_document",
            {"projectId": kb["kb_id"], "fileName": "notes.txt", "content": "volcanic ash clouds"},
        )
    )
    assert second["documentId"] == first["documentId"]
    listed = ok(await mcp.call_tool("kb_list_documents", {"kb": kb["kb_id"]}))
    assert [d["name"] for d in listed["items"]] == ["notes.txt"]
    assert listed["items"][0]["revision"] == 2
    hits = ok(
        await mcp.call_tool(
            "search_docs", {"projectId": kb["kb_id"], "query": "volcanic ash", "minScore": 0}
        )
    )
    assert [r["content"] for r in hits["results"]] == ["volcanic ash clouds"]


async def test_compat_project_id_takes_either_form_of_a_kb_uuid(stack, mcp):
    """New KB ids are UUIDs (dashed); a project is found by that id and by the same UUID
    written as 32 hex digits."""
    kb = await new_kb(stack)
    assert str(uuid.UUID(kb["kb_id"])) == kb["kb_id"]
    for form in (kb["kb_id"], uuid.UUID(kb["kb_id"]).hex):
        ok(await mcp.call_tool("search_docs", {"projectId": form, "query": "anything"}))


# ---- manageKnowledge --------------------------------------------------------------------------


async def test_manage_knowledge_search_honours_source_and_counts_all_matches(mcp):
    """search with a sourceId returns only that source's chunks; totalMatches counts every
    matching chunk, not only the `limit` returned; a chunk without uri says `uri: null`."""
    source_a, source_b = uid("src-a"), uid("src-b")
    for i in range(3):
        for source in (source_a, source_b):
            ok(
                await mcp.call_tool(
                    "manageKnowledge",
                    {
                        "operation": "ingest",
                        "content": f"Lighthouse keeper log {i} for {source}: lamp trimmed.",
                        "sourceId": source,
                    },
                )
            )
    found = ok(
        await mcp.call_tool(
            "manageKnowledge",
            {"operation": "search", "query": "lighthouse lamp", "sourceId": source_a, "limit": 2},
        )
    )
    assert {c["sourceId"] for c in found["chunks"]} == {source_a}
    assert len(found["chunks"]) == 2 and found["totalMatches"] >= 3, found
    assert all("uri" in c and c["uri"] is None for c in found["chunks"])
    assert all(c["matchType"] in ("semantic", "keyword", "hybrid") for c in found["chunks"])
    assert "documentId" not in found and "chunk" not in found
    ingested = ok(await mcp.call_tool("manageKnowledge", {"operation": "ingest", "content": "x y"}))
    assert ingested["uri"] is None and "chunks" not in ingested


# ---- schemas ----------------------------------------------------------------------------------


def _properties(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every property of a schema and of the $defs it uses, with its path."""
    defs = schema.get("$defs", {})
    found, seen = [], set()

    def walk(node: dict[str, Any], path: str) -> None:
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            if name not in seen:
                seen.add(name)
                walk(defs[name], name)
            return
        for sub in [*node.get("anyOf", []), *([node["items"]] if "items" in node else [])]:
            walk(sub, path)
        for name, prop in node.get("properties", {}).items():
            found.append((f"{path}.{name}", prop))
            walk(prop, f"{path}.{name}")

    walk(schema, "")
    return found


async def test_tool_schemas_are_tight_and_described(mcp):
    """Every input property has a description; kb_upload requires one of content (with
    name), url or path; scores are bounded; matchType is an enum; the media types are
    listed; destructiveHint is true exactly where a call deletes or overwrites."""
    listed = await tools(mcp)
    for name, tool in listed.items():
        undescribed = [p for p, prop in _properties(tool.input_schema) if "description" not in prop]
        assert not undescribed, (name, undescribed)
        assert tool.input_schema.get("additionalProperties") is False, name

    upload = Draft202012Validator(listed["kb_upload"].input_schema)
    assert upload.is_valid({"name": "a", "content": "x"})
    assert upload.is_valid({"url": "https://example.com/a"})
    for bad in ({}, {"content": "x"}, {"name": "a", "content": "x", "path": "a.md"}):
        assert not upload.is_valid(bad), bad
    manage = Draft202012Validator(listed["manageKnowledge"].input_schema)
    assert not manage.is_valid({"operation": "search"})
    assert manage.is_valid({"operation": "search", "query": "q"})
    assert not manage.is_valid({"operation": "getChunk", "chunkId": "abc-123"})

    min_score = listed["kb_search"].input_schema["properties"]["min_score"]["anyOf"][0]
    assert (min_score["minimum"], min_score["maximum"]) == (0, 1)
    similarity = listed["kb_search"].input_schema["properties"]["min_similarity"]["anyOf"][0]
    assert (similarity["minimum"], similarity["maximum"]) == (-1, 1)
    min_score = listed["search_docs"].input_schema["properties"]["minScore"]
    assert (min_score["minimum"], min_score["maximum"]) == (0, 1)
    chunk = listed["manageKnowledge"].output_schema["$defs"]["KnowledgeChunk"]
    assert chunk["properties"]["matchType"]["anyOf"][0]["enum"] == ["semantic", "keyword", "hybrid"]
    for tool, field in (("upload_document", "mimeType"), ("kb_upload", "mime_type")):
        described = listed[tool].input_schema["properties"][field]["description"]
        assert all(m in described for m in SUPPORTED), (tool, described)

    destructive = {n for n, t in listed.items() if t.annotations.destructive_hint}
    assert destructive == {
        "kb_delete",
        "kb_delete_source",
        "delete_document",
        "manageKnowledge",
        "kb_upload",
        "upload_document",
        "kb_set_collection",
        "kb_update_document",
        "kb_update",
        "kb_source_update",
        "kb_source_remove",
    }
    assert not any(listed[n].annotations.read_only_hint for n in destructive)


# ---- the TypeScript SDK -------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_typescript_sdk_reads_the_message_of_a_failing_tool(stack, tmp_path, transport):
    """The official TypeScript SDK (as in the MCP Inspector and desktop agents) calls a tool
    that fails: it raises nothing, gets isError with the server's message as text, and no
    structured content that it would hold to the output schema."""
    if why := ts_sdk_missing():
        pytest.skip(why)
    if transport == "http":
        target, env = f"{stack.base}/mcp", {}
    else:
        target = json.dumps([*kbmesh_command(), "mcp"])
        env = {
            **bus_env(stack.rt),
            "KBMESH_MCP_TOOLSETS": "core,compat",
            "KBMESH_DATA_DIR": str(tmp_path),
            "KBMESH_LOG_LEVEL": "WARNING",
        }
    outcome = await ts_call_tool(
        transport, target, "search_docs", {"query": "x", "projectId": "no-such-project"}, env
    )
    assert outcome["raised"] is None, outcome
    result = outcome["result"]
    assert result["isError"] is True and "structuredContent" not in result, result
    assert "project 'no-such-project' not found" in result["content"][0]["text"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_typescript_sdk_accepts_search_results_that_link_documents(
    stack, tmp_path, transport
):
    """The official TypeScript SDK calls kb_search: it accepts the structured result (checked
    against the output schema) beside the resource links to the cited documents, and reading
    a link with it gives that document's text."""
    if why := ts_sdk_missing():
        pytest.skip(why)
    kb = await new_kb(stack)
    text = "The lighthouse keeper trims the wick at dusk and winds the clockwork at midnight."
    r = await stack.client.post(
        f"/v1/kbs/{kb['kb_id']}/documents?wait=true", json={"name": "keeper.txt", "content": text}
    )
    assert r.json()["status"] == "complete", r.text
    document_id = r.json()["document_id"]
    if transport == "http":
        target, env = f"{stack.base}/mcp", {}
    else:
        target = json.dumps([*kbmesh_command(), "mcp"])
        env = {
            **bus_env(stack.rt),
            "KBMESH_MCP_TOOLSETS": "core,compat",
            "KBMESH_DATA_DIR": str(tmp_path),
            "KBMESH_LOG_LEVEL": "WARNING",
        }
    outcome = await ts_call_tool(
        transport, target, "kb_search", {"kb": kb["name"], "query": "who trims the wick"}, env
    )
    assert outcome["raised"] is None, outcome
    result = outcome["result"]
    assert not result.get("isError") and result["structuredContent"]["hits"], result
    links = [c for c in result["content"] if c["type"] == "resource_link"]
    assert [(c["uri"], c["name"]) for c in links] == [
        (f"kbmesh://documents/{document_id}", "keeper.txt")
    ]
    (read,) = outcome["linked"]["contents"]
    assert read["text"].strip() == text


# ---- REST shares the operations --------------------------------------------------------------


async def test_rest_validation_problems_name_the_first_field_at_the_top(stack):
    """A 422 problem has `field` at the top level (the first of `errors`), as the README says,
    for body fields and for whitespace-only content alike."""
    r = await stack.client.post("/v1/kbs", json={"name": uid("kb"), "chunk_size": 5000})
    assert r.status_code == 422, r.text
    problem = r.json()
    assert problem["field"] == "chunk_size" == problem["errors"][0]["field"], problem
    r = await stack.client.post("/v1/documents?wait=true", json={"name": "a.txt", "content": " "})
    assert r.status_code == 422 and r.json()["field"] == "content", r.text


async def test_rest_uploads_by_path_and_replaces_by_uri_like_the_tools(stack):
    """REST runs the operations the tools use: a document read from a server path (under the
    upload root), and a second upload with the same uri and replace_same_uri that replaces
    the first instead of adding another."""
    kb = await new_kb(stack)
    (stack.root / "tides.md").write_text("# Tides\n\nThe moon pulls the oceans into tides.")
    r = await stack.client.post(
        f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
        json={"path": "tides.md", "replace_same_uri": True},
    )
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["status"] == "complete" and first["name"] == "tides.md", first
    assert first["mime_type"] == "text/markdown"
    again = await stack.client.post(
        f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
        json={"path": "tides.md", "replace_same_uri": True},
    )
    assert again.json()["document_id"] == first["document_id"], again.text
    listed = (await stack.client.get("/v1/documents", params={"kb": kb["kb_id"]})).json()
    assert listed["total"] == 1 and listed["items"][0]["revision"] == 2
