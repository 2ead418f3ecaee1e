"""`kbmesh mock` answers every REST operation and tool call with its contract example, over
REST, /api/v1/tools and MCP; requests that break the schemas get the gateway's structured
errors; and it runs without NATS, a store or a model."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from services.contracts.export import TOOLS_PATH, Contracts, build
from services.contracts.mock import create_mock_app
from services.gateway.tools import TOOLS
from tests.support.asgi import serve_app
from tests.support.contracts import errors, rest_errors, send_example
from tests.support.mcp_client import failed, http_session

FILES = build().files()
REST_FIXTURES = sorted(p for p in FILES if p.startswith("rest/examples/"))
TOOL_FIXTURES = [
    (name, i) for name in sorted(TOOLS) for i in range(len(FILES[f"tools/{name}.examples.json"]))
]


@pytest.mark.parametrize("path", REST_FIXTURES)
async def test_mock_answers_each_rest_operation_with_its_fixture(
    mock: httpx.AsyncClient, contracts: Contracts, path: str
):
    example = FILES[path]
    response = await send_example(mock, example)
    assert response.status_code == example["response"]["status"], response.text
    assert response.json() == example["response"]["body"]
    if not example["path"].startswith(TOOLS_PATH + "/"):
        assert not rest_errors(contracts, (example["method"], example["path"]), response)


@pytest.mark.parametrize(("name", "index"), TOOL_FIXTURES)
async def test_mock_answers_each_tool_call_with_its_example(
    mock: httpx.AsyncClient, name: str, index: int
):
    example = FILES[f"tools/{name}.examples.json"][index]
    response = await mock.post(f"{TOOLS_PATH}/{name}", json=example["input"])
    assert response.status_code == 200, response.text
    assert response.json() == example["output"]


async def test_mock_rejects_requests_that_break_the_schemas(
    mock: httpx.AsyncClient, contracts: Contracts
):
    """Wrong types, missing required fields and parameters, cross-field rules and unknown tools
    are refused with the gateway's error bodies (a problem document for REST, the structured
    tool error for tools); the mock keeps serving."""
    refused_rest = [
        ("POST", "/v1/kbs", {"json": {"name": 5}}, "name"),
        ("POST", "/v1/kbs", {"json": {}}, "name"),
        ("DELETE", "/v1/documents", {}, "source_id"),
        ("GET", "/v1/kbs", {"params": {"limit": "many"}}, "limit"),
        ("GET", "/v1/chunks/abc", {"params": {"neighbors": 9}}, "neighbors"),
        (
            "POST",
            "/v1/search",
            {"content": b"{not json", "headers": {"content-type": "application/json"}},
            "body",
        ),
        (
            "POST",
            "/v1/search",
            {"json": {"query": "q", "filters": {"metadata": [{"key": "a"}]}}},
            "filters",
        ),
    ]
    for method, path, kwargs, field in refused_rest:
        response = await mock.request(method, path, **kwargs)
        assert response.status_code == 422, (method, path, response.text)
        assert response.headers["content-type"] == "application/problem+json"
        body = response.json()
        assert body["error_type"] == "ValidationError" and body["status"] == 422
        assert any(e["field"].startswith(field) for e in body["errors"]), body
        key = (method, path if path != "/v1/chunks/abc" else "/v1/chunks/{chunk_id}")
        assert not rest_errors(contracts, key, response)

    tool_error = FILES["tools/error.schema.json"]
    refused_tools = [
        ("kb_search", {"query": "q", "top_k": "5"}, "ValidationError", 422),
        ("kb_search", {"top_k": 5}, "ValidationError", 422),
        (
            "kb_upload",
            {"name": "a.md", "content": "x", "url": "https://example.com/a"},
            "ValidationError",
            422,
        ),
        ("delete_document", {"filepath": ""}, "ValidationError", 422),
        ("no_such_tool", {}, "NotFound", 404),
    ]
    for name, arguments, error_type, status in refused_tools:
        response = await mock.post(f"{TOOLS_PATH}/{name}", json=arguments)
        assert response.status_code == status, (name, response.text)
        body = response.json()
        assert body["status"] == "error" and body["error_type"] == error_type, body
        assert not errors(tool_error, body)
    assert (await mock.get("/healthz")).status_code == 200


async def test_mock_over_mcp_lists_the_tools_and_answers_from_examples(contracts: Contracts):
    """With the official MCP client over streamable HTTP: the mock offers every tool under its
    own name with the gateway's input schema, answers a call with the example's structured
    result, and flags a call that breaks the schema as a tool error."""
    async with (
        serve_app(create_mock_app(contracts=contracts)) as base,
        http_session(base) as session,
    ):
        listed = {t.name: t for t in (await session.list_tools()).tools}
        assert set(listed) == set(TOOLS)
        for name, tool in listed.items():
            assert tool.input_schema == TOOLS[name].input_schema, name
            assert tool.output_schema == TOOLS[name].output_schema, name

        example = FILES["tools/kb_search.examples.json"][0]
        result = await session.call_tool("kb_search", example["input"])
        assert not result.is_error
        assert result.structured_content == example["output"]
        assert "vacation-policy.md" in result.content[0].text

        bad = await session.call_tool("kb_search", {"query": 42})
        assert failed(bad, "ValidationError")["field"] == "query"

        # The example's hits are linked as the gateway links them; the mock holds no
        # documents, so it lists no resources and reads each as not found, saying why.
        link = result.content[1]
        assert link.type == "resource_link" and link.uri.startswith("kbmesh://documents/")
        assert (await session.list_resources()).resources == []
        with pytest.raises(MCPError, match="mock") as caught:
            await session.read_resource(link.uri)
        assert caught.value.error.code == INVALID_PARAMS


def test_mock_runs_without_nats_a_store_or_a_model():
    """Building the mock loads no model, embedding or vector-store library and opens no
    connection: it only needs the contracts."""
    heavy = ["torch", "sentence_transformers", "litellm", "qdrant_edge", "qdrant_client"]
    script = (
        "import json, sys, time\n"
        "from services.contracts.mock import create_mock_app\n"
        "t = time.perf_counter(); create_mock_app()\n"
        f"print(json.dumps({{'loaded': [m for m in {heavy!r} if m in sys.modules], "
        "'seconds': time.perf_counter() - t}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["loaded"] == [], report


async def test_mock_answers_say_what_the_request_asked(mock: httpx.AsyncClient):
    """The mock echoes the request: an ingest into another source answers with that source,
    a search with its query, and deleting an id no example names deletes nothing. Arguments
    the real server refuses (a chunk id that is no UUID) the mock refuses the same way, since
    both hold them to the same schema and model."""
    ingest = {"operation": "ingest", "content": "Runbook text.", "sourceId": "docs"}
    body = (await mock.post(f"{TOOLS_PATH}/manageKnowledge", json=ingest)).json()
    assert body["sourceId"] == "docs", body
    search = {"operation": "search", "query": "how do I rotate keys?"}
    body = (await mock.post(f"{TOOLS_PATH}/manageKnowledge", json=search)).json()
    assert body["query"] == "how do I rotate keys?", body
    body = (await mock.post(f"{TOOLS_PATH}/kb_delete", json={"document_id": "missing"})).json()
    assert (body["deleted_count"], body["status"], body["document_id"]) == (
        0,
        "not_found",
        "missing",
    ), body
    refused = await mock.post(
        f"{TOOLS_PATH}/manageKnowledge", json={"operation": "getChunk", "chunkId": "abc-123"}
    )
    assert refused.status_code == 422 and refused.json()["field"] == "chunkId", refused.text


async def test_mock_takes_files_on_the_upload_routes_as_the_gateway_does(mock: httpx.AsyncClient):
    """A multipart form and a raw file body are uploads to the mock too, answered with the
    upload example; the raw body's fields are held to their schema (a repeated `tags` is a
    list), and other routes still take JSON only."""
    example = FILES["rest/examples/upload_to_kb_v1_kbs__kb__documents_post.json"]
    form = await mock.post(
        "/v1/kbs/handbook/documents",
        files={"file": ("notes.md", b"# Notes", "text/markdown")},
        data={"tags": ["a", "b"]},
    )
    assert form.status_code == example["response"]["status"], form.text
    assert form.json() == example["response"]["body"]
    raw = await mock.post(
        "/v1/documents",
        params={"name": "notes.md", "tags": ["a", "b"], "replace_same_uri": "true"},
        content=b"# Notes",
        headers={"Content-Type": "text/markdown"},
    )
    assert raw.status_code in (200, 202), raw.text
    refused = await mock.post(
        "/v1/documents",
        params={"name": "notes.md", "replace_same_uri": "maybe"},
        content=b"# Notes",
        headers={"Content-Type": "text/markdown"},
    )
    assert refused.status_code == 422 and refused.json()["field"] == "replace_same_uri"
    other = await mock.post("/v1/kbs", files={"file": ("notes.md", b"# Notes", "text/markdown")})
    assert other.status_code == 422, other.text
