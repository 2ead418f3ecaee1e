"""Every format kbmesh reads, through the real pipeline: each fixture in tests/fixtures/formats
uploaded through REST (no declared type: the server sniffs it) and through `kbmesh ingest`,
then found by keyword search for the one word only it holds. The PDF's hit names page 2, the
presentation's slide 2, the markdown's its heading path, in hits, `GET /v1/chunks/{id}`, the
MCP tool's text and /v1/ask citations."""

from __future__ import annotations

import base64
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.messages.queries import SearchResponse
from services.gateway.tools.rendering import render_search
from tests.conftest import running_stack
from tests.fixtures.formats.make_fixtures import FIXTURES, SPEAKER_NOTE
from tests.support.domain import create_kb, uid
from tests.support.mcp_client import kbmesh_ingest, serve_http

FORMATS = Path(__file__).parent.parent / "fixtures" / "formats"


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders) -> AsyncIterator[tuple[Any, httpx.AsyncClient, str]]:
    async with (
        running_stack(tmp_path_factory.mktemp("formats"), embedders=embedders) as (rt, client),
        serve_http(rt) as (base, _app),
    ):
        yield rt, client, base


async def keyword_hits(client: httpx.AsyncClient, word: str, **filters: Any) -> list[dict]:
    body = {"query": word, "mode": "keyword", "top_k": 3, "filters": filters or None}
    r = await client.post("/v1/search", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["hits"])


async def test_every_format_uploaded_through_rest_is_found_by_its_word(stack):
    """No mime type declared: the server reads each file by its bytes and name."""
    _rt, client, _base = stack
    kb = await create_kb(client)
    source = f"rest-{uid()}"
    ids = {}
    for name in FIXTURES:
        body = {
            "name": name,
            "content": base64.b64encode((FORMATS / name).read_bytes()).decode(),
            "content_encoding": "base64",
            "source_id": source,
        }
        r = await client.post(f"/v1/kbs/{kb['kb_id']}/documents?wait=true", json=body)
        assert r.status_code in (200, 202), (name, r.text)
        assert r.json()["status"] == "complete", (name, r.json())
        ids[name] = r.json()["document_id"]
    missing = []
    for name, word in FIXTURES.items():
        hits = await keyword_hits(client, word, source_ids=[source])
        if not hits or hits[0]["document_id"] != ids[name] or word not in hits[0]["content"]:
            missing.append((name, word, hits[:1]))
    assert not missing, missing

    view = (await client.get(f"/v1/documents/{ids['report.pdf']}")).json()
    assert view["mime_type"] == "application/pdf"
    [pdf] = (await keyword_hits(client, FIXTURES["report.pdf"], source_ids=[source]))[:1]
    assert pdf["pages"] == [2], pdf
    [deck] = (await keyword_hits(client, FIXTURES["deck.pptx"], source_ids=[source]))[:1]
    assert deck["slides"] == [2], deck
    [said] = (await keyword_hits(client, SPEAKER_NOTE, source_ids=[source]))[:1]
    assert (said["document_id"], said["slides"]) == (ids["deck.pptx"], [2]), said
    [notes] = (await keyword_hits(client, FIXTURES["notes.md"], source_ids=[source]))[:1]
    assert notes["heading_path"] == ["Lab notes", "Setup", "Cooling"], notes

    r = await client.get(f"/v1/chunks/{pdf['chunk_id']}")
    assert r.status_code == 200, r.text
    assert r.json()["chunk"]["pages"] == [2]
    r = await client.post(
        "/api/v1/tools/kb_search",
        json={"query": FIXTURES["notes.md"], "kb": kb["kb_id"], "mode": "keyword"},
    )
    assert r.status_code == 200, r.text
    found = SearchResponse.model_validate(r.json())
    assert found.hits[0].heading_path == ["Lab notes", "Setup", "Cooling"]
    # What an MCP client reads as the tool's text.
    assert "in: Lab notes › Setup › Cooling" in render_search(found)
    r = await client.post(
        "/api/v1/tools/kb_search",
        json={"query": FIXTURES["report.pdf"], "kb": kb["kb_id"], "mode": "keyword"},
    )
    assert "in: page 2" in render_search(SearchResponse.model_validate(r.json()))


async def test_every_format_loaded_with_the_cli_is_found_by_its_word(stack, tmp_path):
    """`kbmesh ingest` uploads every fixture (it asks the server which types it reads) and
    counts them in its summary; each is then found by its word."""
    _rt, client, base = stack
    kb = await create_kb(client)
    root = tmp_path / "formats"
    root.mkdir()
    for name in FIXTURES:
        shutil.copy(FORMATS / name, root / name)
    source = f"cli-{uid()}"
    status, lines = await kbmesh_ingest(base, root, "--kb", kb["name"], "--source-id", source)
    assert status == 0, lines
    assert lines[-1] == f"{len(FIXTURES)} uploaded, 0 unchanged, 0 deleted, 0 skipped, 0 failed"
    missing = []
    for name, word in FIXTURES.items():
        hits = await keyword_hits(client, word, source_ids=[source])
        if not hits or hits[0]["document_name"] != name:
            missing.append((name, word, hits[:1]))
    assert not missing, missing
    [pdf] = (await keyword_hits(client, FIXTURES["report.pdf"], source_ids=[source]))[:1]
    assert pdf["pages"] == [2], pdf
