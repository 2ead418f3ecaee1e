"""`kbmesh ingest` as a user runs it: the command in its own process against a running stack
over real HTTP. It loads a nested folder, skips what the server cannot extract, uploads
nothing unchanged on a re-run, deletes the documents of removed files with --sync, lists
failures with their reasons, and ends with the one-line summary. /metrics counts the same
work."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cli.runtime import gateway_app
from tests.conftest import running_stack
from tests.support.asgi import serve_app
from tests.support.domain import create_kb, uid
from tests.support.mcp_client import kbmesh_ingest

TREE = {
    "README.md": "# Handbook\n\nHow the platform team runs the knowledge base.",
    "notes.txt": "Notes about rotating the on-call pager every Monday morning.",
    "page.html": "<html><body><h1>Status page</h1><p>All systems nominal.</p></body></html>",
    "owners.json": '{"team": "platform", "channel": "#platform-oncall"}',
    "docs/install.md": "# Install\n\nRun the installer with the default options.",
    "docs/upgrade.md": "# Upgrade\n\nUpgrade one replica at a time and watch the dashboards.",
    "docs/backup.txt": "Back up the JetStream store directory every night.",
    "docs/faq.md": "# FAQ\n\nWhy is my document pending? Because OCR has not run yet.",
    "docs/guide/search.md": "# Search\n\nHybrid search fuses dense and keyword rankings.",
    "docs/guide/tags.md": "# Tags\n\nTags decide which knowledge bases hold a document.",
    "docs/guide/limits.txt": "Uploads are limited to ten megabytes each.",
    "docs/guide/glossary.md": "# Glossary\n\nA chunk is a piece of a document's text.",
}


class Recorded:
    """The gateway app, noting the media type of every request body it is sent."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bodies: list[tuple[str, str, str]] = []  # (method, path, content type)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            media = dict(scope["headers"]).get(b"content-type", b"").decode()
            self.bodies.append((scope["method"], scope["path"], media.split(";")[0]))
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders) -> AsyncIterator[tuple[Any, httpx.AsyncClient, str]]:
    async with running_stack(
        # The web page of the URL test is served on loopback, which the egress guard
        # refuses unless allow-listed.
        tmp_path_factory.mktemp("ingest-cli"),
        embedders=embedders,
        egress={"allowlist": ["127.0.0.1"]},
    ) as (rt, client):
        rt.recorded = Recorded(gateway_app(rt))
        async with serve_app(rt.recorded, limits=rt.settings.http) as base:
            yield rt, client, base


def make_tree(root: Path) -> None:
    for rel, text in TREE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "logo.bin").write_bytes(bytes(range(256)) * 4)  # unsupported: skipped
    (root / ".gitignore").write_text("build/\n*.tmp\n")
    (root / "build").mkdir()
    (root / "build" / "out.md").write_text("# generated, ignored")
    (root / "scratch.tmp").write_text("ignored")
    (root / ".private").mkdir()
    (root / ".private" / "secret.md").write_text("# hidden folders are skipped")


async def metric(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    """One sample of /metrics, read with Prometheus's own text parser."""
    r = await client.get("/metrics")
    assert r.status_code == 200, r.text
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


async def source_documents(client: httpx.AsyncClient, source: str) -> dict[str, dict[str, Any]]:
    r = await client.get("/v1/documents", params={"source_id": source, "limit": 500})
    assert r.status_code == 200, r.text
    return {d["uri"]: d for d in r.json()["items"]}


async def test_folder_ingest_skips_unchanged_and_syncs_deletions(stack, tmp_path):
    """12 files in three levels (plus a binary, an ignored build folder, a hidden folder):
    the first run uploads the 12 — as files in multipart forms, never as base64 — and
    reports the binary skipped; the second uploads nothing and embeds nothing;
    after deleting one file and editing another, --sync deletes exactly the deleted file's
    document and re-uploads the edited one."""
    rt, client, base = stack
    kb = await create_kb(client)
    root = tmp_path / "handbook"
    make_tree(root)
    source = f"repo-{uid()}"
    args = (root, "--kb", kb["name"], "--source-id", source, "--tags", "handbook")

    indexed_before = await metric(client, "kbmesh_documents_indexed_total")
    latencies_before = await metric(client, "kbmesh_index_seconds_count")
    chunks_before = await metric(client, "kbmesh_chunks_embedded_total")
    status, lines = await kbmesh_ingest(base, *args)
    assert status == 0, lines
    assert lines[-1] == "12 uploaded, 0 unchanged, 0 deleted, 1 skipped, 0 failed", lines
    assert any(line.startswith("skipped logo.bin: unsupported") for line in lines), lines
    stored = await source_documents(client, source)
    assert set(stored) == set(TREE), "uris are the paths relative to the folder given"
    assert all(d["status"] == "complete" and d["kb_ids"] == [kb["kb_id"]] for d in stored.values())
    assert all("modified_at" in d["metadata"] and d["tags"] for d in stored.values())
    uploads = {(m, media) for m, path, media in rt.recorded.bodies if path.endswith("/documents")}
    assert uploads == {("GET", ""), ("POST", "multipart/form-data")}, uploads
    stats = (await client.get(f"/v1/kbs/{kb['kb_id']}/stats")).json()
    assert stats["progress"] == {
        "total": 12,
        "indexed": 12,
        "pending": 0,
        "failed": 0,
        "reindex": None,
    }
    # The counters saw exactly this run: 12 documents, every chunk of them embedded once.
    assert await metric(client, "kbmesh_documents_indexed_total") - indexed_before == 12
    assert await metric(client, "kbmesh_index_seconds_count") - latencies_before == 12
    chunks = await metric(client, "kbmesh_chunks_embedded_total")
    assert chunks - chunks_before == stats["chunk_count"]

    status, lines = await kbmesh_ingest(base, *args)
    assert status == 0, lines
    assert lines[-1] == "0 uploaded, 12 unchanged, 0 deleted, 1 skipped, 0 failed", lines
    assert await metric(client, "kbmesh_chunks_embedded_total") == chunks

    (root / "docs" / "guide" / "tags.md").unlink()
    (root / "docs" / "faq.md").write_text("# FAQ\n\nPending documents wait for indexing.")
    status, lines = await kbmesh_ingest(base, *args, "--sync")
    assert status == 0, lines
    assert lines[-1] == "1 uploaded, 10 unchanged, 1 deleted, 1 skipped, 0 failed", lines
    after = await source_documents(client, source)
    assert set(after) == set(TREE) - {"docs/guide/tags.md"}
    r = await client.get(f"/v1/documents/{stored['docs/guide/tags.md']['document_id']}")
    assert r.status_code == 404
    # The edited file updated its document (same id, new revision); the rest are untouched.
    assert after["docs/faq.md"]["document_id"] == stored["docs/faq.md"]["document_id"]
    assert after["docs/faq.md"]["revision"] > stored["docs/faq.md"]["revision"]
    for uri in set(after) - {"docs/faq.md"}:
        assert after[uri]["revision"] == stored[uri]["revision"], uri


async def test_failed_extraction_is_listed_and_exits_1(stack, tmp_path):
    """A .pdf that is no PDF fails extraction on the server: it is listed with the reason
    above the summary, the good file still loads, and the exit status is 1."""
    _rt, client, base = stack
    kb = await create_kb(client)
    (tmp_path / "good.md").write_text("# Good\n\nThis one is fine.")
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.7 this is not really a pdf")
    failed_before = await metric(client, "kbmesh_documents_failed_total", stage="ingest")
    status, lines = await kbmesh_ingest(base, tmp_path, "--kb", kb["kb_id"])
    assert status == 1, lines
    assert lines[-1] == "1 uploaded, 0 unchanged, 0 deleted, 0 skipped, 1 failed", lines
    failure = next(line for line in lines if line.startswith("failed broken.pdf: "))
    assert "PDF" in failure, failure
    assert lines.index(failure) < len(lines) - 1
    failed = await metric(client, "kbmesh_documents_failed_total", stage="ingest")
    assert failed - failed_before == 1


async def test_uploads_still_processing_when_the_servers_wait_ends_are_polled(
    stack, tmp_path, monkeypatch
):
    """The gateway's wait for indexing ends before embed is done (a long queue): each upload
    answers `processing`, and the command keeps looking until the documents are indexed,
    counting them uploaded with their chunks."""
    rt, client, base = stack
    monkeypatch.setattr(rt.gateway.waiting, "timeout_seconds", 0.001)
    kb = await create_kb(client)
    for name in ("one.md", "two.md"):
        (tmp_path / name).write_text(f"# {name}\n\nA page that is indexed after the wait.")
    status, lines = await kbmesh_ingest(base, tmp_path, "--kb", kb["kb_id"])
    assert status == 0, lines
    assert lines[-1] == "2 uploaded, 0 unchanged, 0 deleted, 0 skipped, 0 failed", lines
    progress = [line for line in lines if line.startswith("progress: ")]
    assert progress and progress[-1].startswith("progress: 2/2 files"), lines
    assert " 0 chunks indexed" not in progress[-1], lines
    docs = (await client.get("/v1/documents", params={"kb": kb["kb_id"]})).json()["items"]
    assert sorted(d["status"] for d in docs) == ["complete", "complete"]


PAGE = b"""<html><head><title>Runbook</title></head><body><h1>Runbook</h1><p>Restart the
gateway first, then the workers, one replica at a time.</p></body></html>"""


async def runbook_site(scope: dict[str, Any], receive: Any, send: Any) -> None:
    headers = [(b"content-type", b"text/html; charset=utf-8")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": PAGE})


async def test_url_ingest_loads_one_web_page(stack):
    """`kbmesh ingest URL` has the server fetch the page: one document, indexed, with the
    URL as its uri, found by a search."""
    _rt, client, base = stack
    kb = await create_kb(client)
    async with serve_app(runbook_site, lifespan="off") as site:
        url = f"{site}/runbook.html"
        status, lines = await kbmesh_ingest(base, url, "--kb", kb["name"])
    assert status == 0, lines
    assert lines[-1] == "1 uploaded, 0 unchanged, 0 deleted, 0 skipped, 0 failed", lines
    docs = (await client.get("/v1/documents", params={"kb": kb["kb_id"]})).json()["items"]
    assert [(d["uri"], d["status"]) for d in docs] == [(url, "complete")]
    r = await client.post("/v1/search", json={"query": "restart order", "kb_ids": [kb["kb_id"]]})
    assert r.json()["hits"][0]["document_id"] == docs[0]["document_id"]


async def test_a_missing_kb_is_reported_first_with_the_fix(stack, tmp_path):
    """An unknown KB is the first thing said, with the fix, and nothing is read or uploaded
    (exit 1); with --create-kb the KB is created and the files load into it."""
    _rt, client, base = stack
    (tmp_path / "a.md").write_text("# A\n\nAbout alpha.")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)))
    name = f"new-{uid()}"
    status, lines = await kbmesh_ingest(base, tmp_path, "--kb", name)
    assert status == 1, lines
    assert lines[0].startswith(f"kbmesh ingest: knowledge base {name!r} not found"), lines
    assert "--create-kb" in lines[0]
    assert lines[-1] == "0 uploaded, 0 unchanged, 0 deleted, 0 skipped, 0 failed", lines
    assert (await client.get(f"/v1/kbs/{name}")).status_code == 404

    status, lines = await kbmesh_ingest(base, tmp_path, "--kb", name, "--create-kb")
    assert status == 0, lines
    assert lines[0].startswith(f"created knowledge base {name!r}"), lines
    assert "skipped blob.bin: unsupported type (binary content)" in lines
    assert lines[-1] == "1 uploaded, 0 unchanged, 0 deleted, 1 skipped, 0 failed", lines
    stats = (await client.get(f"/v1/kbs/{name}/stats")).json()
    assert stats["document_count"] == 1


async def test_bad_usage_exits_2(stack, tmp_path):
    """A path that does not exist is bad usage: exit status 2 and nothing uploaded."""
    _rt, _client, base = stack
    status, lines = await kbmesh_ingest(base, tmp_path / "missing")
    assert status == 2, lines
    assert "no such file or folder" in lines[-1]


async def test_metrics_count_searches(stack):
    """Every search request counts once, and its latency lands in the histogram."""
    _rt, client, _base = stack
    before = await metric(client, "kbmesh_search_requests_total")
    observed = await metric(client, "kbmesh_search_seconds_count")
    for query in ("pager rotation", "hybrid search"):
        r = await client.post("/v1/search", json={"query": query})
        assert r.status_code == 200, r.text
    assert await metric(client, "kbmesh_search_requests_total") - before == 2
    assert await metric(client, "kbmesh_search_seconds_count") - observed == 2
    assert await metric(client, "kbmesh_dead_letters") >= 0
    r = await client.get("/metrics")
    families = {f.name for f in text_string_to_metric_families(r.text)}
    assert {
        "kbmesh_documents_indexed",
        "kbmesh_documents_failed",
        "kbmesh_chunks_embedded",
        "kbmesh_search_requests",
        "kbmesh_index_seconds",
        "kbmesh_embed_batch_seconds",
        "kbmesh_search_seconds",
        "kbmesh_pending_messages",
        "kbmesh_dead_letters",
    } <= families
