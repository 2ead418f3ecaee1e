"""Uploading files as bytes, against the real stack over real HTTP and ASGI: a multipart form
(the file plus the same fields a JSON body has) or a raw body with its own Content-Type
(fields as query parameters). The bytes travel to ingest as one staged object, never as
base64; ingest alone decides the type; an over-size body is refused while it streams and
leaves nothing staged; bad forms get a clear 4xx and change nothing."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from services.common.domain.content import STAGING_PREFIX
from tests.conftest import running_stack
from tests.support.domain import (
    LONG_DOCS,
    LONG_QUERIES,
    create_kb,
    registry_counts,
    settled,
    text_pdf,
    uid,
    uploaded_events,
)
from tests.support.mcp_client import serve_http

ORG = "local"
MAX_BYTES = 200_000  # this module's upload limit (KBMESH_MAX_CONTENT_BYTES)


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders) -> AsyncIterator[tuple[Any, httpx.AsyncClient, str]]:
    async with (
        running_stack(
            tmp_path_factory.mktemp("uploads"), embedders=embedders, max_content_bytes=MAX_BYTES
        ) as (rt, client),
        serve_http(rt) as (base, _app),
    ):
        yield rt, client, base


async def staged_objects(rt: Any) -> list[str]:
    from nats.js.errors import NotFoundError

    try:
        infos = await rt.registries.texts.store.list(ignore_deletes=True)
    except NotFoundError:
        return []
    return [i.name for i in infos if i.name.startswith(STAGING_PREFIX)]


def docx_bytes(text: str) -> bytes:
    import docx

    document = docx.Document()
    document.add_paragraph(text)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


async def keyword_hits(client: httpx.AsyncClient, word: str, kb_id: str) -> list[dict]:
    body = {"query": word, "mode": "keyword", "top_k": 5, "kb_ids": [kb_id]}
    r = await client.post("/v1/search", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["hits"])


async def test_multipart_upload_is_staged_as_bytes_typed_by_ingest_and_searchable(stack):
    """A PDF sent as a multipart form over real HTTP, under a name that says nothing and with
    a generic part type, is read as a PDF (ingest sniffs it) and found by search. The event
    to ingest references the staged bytes (no inline content, no base64); the stored original
    is byte for byte the file; the staged copy is gone once ingest has stored it. The fields
    ride along as form fields, in any order (tags repeated, metadata as JSON)."""
    rt, client, base = stack
    t = f"t-{uid()}"
    kb = await create_kb(client, tag_ids=[t])
    pdf = text_pdf("Narwhals navigate the fjords by echolocation")
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        r = await http.post(
            f"/v1/kbs/{kb['kb_id']}/documents",
            params={"wait": "true"},
            files={"file": ("field-notes", pdf, "application/octet-stream")},
            data={
                "tags": [t, "arctic"],
                "metadata": json.dumps({"team": "biology", "year": 2024}),
                "source_id": "expedition",
                "uri": "notes/field-notes",
            },
        )
        assert r.status_code == 200, r.text
        up = r.json()
        # Fields after the file part, on the org-wide route with kb_id as a field.
        fields_last = httpx.AsyncClient(base_url=base, timeout=120)
        async with fields_last:
            boundary = "kbmesh-test-boundary"
            body = (
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                f'filename="glaciers.md"\r\nContent-Type: text/markdown\r\n\r\n'
                f"{LONG_DOCS['glaciers.md']}\r\n"
                f'--{boundary}\r\nContent-Disposition: form-data; name="kb_id"\r\n\r\n'
                f"{kb['kb_id']}\r\n"
                f'--{boundary}\r\nContent-Disposition: form-data; name="collection"\r\n\r\n'
                f"ice\r\n--{boundary}--\r\n"
            ).encode()
            r = await fields_last.post(
                "/v1/documents?wait=true",
                content=body,
                headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
            )
        assert r.status_code == 200, r.text
        markdown = r.json()
    await settled(rt)
    seen = await uploaded_events(rt)

    assert up["status"] == "complete" and up["chunk_count"] >= 1, up
    assert up["mime_type"] == "application/pdf" and up["name"] == "field-notes", up
    doc = up["document_id"]
    view = (await client.get(f"/v1/documents/{doc}")).json()
    assert view["mime_type"] == "application/pdf"
    assert view["size_bytes"] == len(pdf)
    assert view["content_checksum"] == hashlib.sha256(pdf).hexdigest()
    assert {t, "arctic"} <= set(view["tags"])
    assert view["metadata"] == {"team": "biology", "year": 2024}
    assert view["source_id"] == "expedition" and view["uri"] == "notes/field-notes"
    assert await rt.registries.texts.get(f"{ORG}/{doc}/original") == pdf
    hits = await keyword_hits(client, "echolocation", kb["kb_id"])
    assert [h["document_id"] for h in hits][:1] == [doc], hits

    event = seen[doc]
    assert event.content is None and event.object_ref == f"{STAGING_PREFIX}{ORG}/{event.event_id}"
    assert await rt.registries.texts.get(event.object_ref) is None, "staged copy left behind"

    assert markdown["status"] == "complete" and markdown["mime_type"] == "text/markdown"
    assert markdown["kb_ids"] == [kb["kb_id"]], markdown
    md_view = (await client.get(f"/v1/documents/{markdown['document_id']}")).json()
    assert md_view["collection"] == "ice" and md_view["name"] == "glaciers.md"
    r = await client.post(
        "/v1/search", json={"query": LONG_QUERIES["glaciers.md"], "kb_ids": [kb["kb_id"]]}
    )
    assert r.json()["hits"][0]["document_id"] == markdown["document_id"]
    assert seen[markdown["document_id"]].content is None
    assert await staged_objects(rt) == []


async def test_raw_body_upload_takes_fields_from_the_query_and_ingest_decides_the_type(stack):
    """The file as the whole body over real HTTP: with its own Content-Type (markdown), with
    a generic one (a DOCX named without an extension: ingest reads its bytes), and streamed
    without a length (chunked). Each is indexed, searchable and stored byte for byte; the
    query carries the fields (tags repeated, metadata as JSON)."""
    rt, client, base = stack
    t = f"t-{uid()}"
    kb = await create_kb(client, tag_ids=[t])
    report = docx_bytes("Quarterly report: the walrus colony grew by a tenth.")
    raft = LONG_DOCS["raft.md"].encode()

    async def chunked() -> AsyncIterator[bytes]:
        for start in range(0, len(raft), 1000):
            yield raft[start : start + 1000]

    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        r = await http.post(
            "/v1/documents",
            params={
                "wait": "true",
                "name": "espresso.md",
                "tags": [t, "coffee"],
                "metadata": json.dumps({"roast": "dark"}),
            },
            content=LONG_DOCS["espresso.md"].encode(),
            headers={"Content-Type": "text/markdown; charset=utf-8"},
        )
        assert r.status_code == 200, r.text
        espresso = r.json()
        r = await http.post(
            f"/v1/kbs/{kb['kb_id']}/documents",
            params={"wait": "true", "name": "report"},
            content=report,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 200, r.text
        docx = r.json()
        r = await http.post(
            f"/v1/kbs/{kb['kb_id']}/documents",
            params={"wait": "true", "name": "raft.md"},
            content=chunked(),
            headers={"Content-Type": "text/markdown"},
        )
        assert r.status_code == 200, r.text
        streamed = r.json()
    await settled(rt)
    seen = await uploaded_events(rt)

    assert espresso["status"] == "complete" and espresso["kb_ids"] == [kb["kb_id"]], espresso
    view = (await client.get(f"/v1/documents/{espresso['document_id']}")).json()
    assert sorted(view["tags"]) == sorted([t, "coffee"]) and view["metadata"] == {"roast": "dark"}
    assert view["mime_type"] == "text/markdown"

    assert docx["status"] == "complete", docx
    assert docx["mime_type"].endswith("wordprocessingml.document"), docx
    hits = await keyword_hits(client, "walrus", kb["kb_id"])
    assert [h["document_id"] for h in hits][:1] == [docx["document_id"]], hits
    stored = await rt.registries.texts.get(f"{ORG}/{docx['document_id']}/original")
    assert stored == report

    assert streamed["status"] == "complete", streamed
    view = (await client.get(f"/v1/documents/{streamed['document_id']}")).json()
    assert view["size_bytes"] == len(raft)
    for result in (espresso, docx, streamed):
        event = seen[result["document_id"]]
        assert event.content is None and event.object_ref, event
    assert await staged_objects(rt) == []


async def test_json_base64_is_decoded_once_and_travels_as_bytes(stack):
    """A JSON body with base64 content keeps working: it is decoded at the entrance, and the
    event to ingest references the staged bytes instead of carrying base64 on."""
    rt, client, _base = stack
    t = f"t-{uid()}"
    kb = await create_kb(client, tag_ids=[t])
    pdf = text_pdf("Puffins nest in burrows on the cliff tops")
    r = await client.post(
        f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
        json={
            "name": "puffins.pdf",
            "content": base64.b64encode(pdf).decode(),
            "content_encoding": "base64",
        },
    )
    assert r.status_code == 200, r.text
    up = r.json()
    await settled(rt)
    seen = await uploaded_events(rt)
    assert up["status"] == "complete" and up["mime_type"] == "application/pdf", up
    event = seen[up["document_id"]]
    assert event.content is None and event.content_encoding == "text", event
    assert event.object_ref == f"{STAGING_PREFIX}{ORG}/{event.event_id}"
    assert await rt.registries.texts.get(f"{ORG}/{up['document_id']}/original") == pdf
    assert await staged_objects(rt) == []


async def test_over_size_file_uploads_are_refused_413_and_leave_nothing_staged(stack):
    """A file over the size limit is refused with a 413 problem body however it comes: a
    multipart form, a raw body that declares its length (refused before it is read), and a
    raw body streamed without a length (refused at the byte that crosses the limit) — over
    real HTTP and through ASGI. Nothing is stored or staged: every count is the same after."""
    rt, client, base = stack
    kb = await create_kb(client, tag_ids=[f"t-{uid()}"])
    await settled(rt)
    before = await registry_counts(rt)
    big = b"a" * (MAX_BYTES + 1)
    exact = b"b" * MAX_BYTES

    async def streamed() -> AsyncIterator[bytes]:
        for start in range(0, len(big), 16384):
            yield big[start : start + 16384]

    path = f"/v1/kbs/{kb['kb_id']}/documents"
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        for sender in (http, client):
            answers = [
                await sender.post(path, files={"file": ("big.txt", big, "text/plain")}),
                await sender.post(
                    path,
                    params={"name": "big.txt"},
                    content=big,
                    headers={"Content-Type": "text/plain"},
                ),
                await sender.post(
                    path,
                    params={"name": "big.txt"},
                    content=streamed(),
                    headers={"Content-Type": "text/plain"},
                ),
            ]
            for r in answers:
                assert r.status_code == 413, r.text[:300]
                assert r.headers["content-type"].startswith("application/problem+json")
                problem = r.json()
                assert problem["error_type"] == "ContentTooLarge"
                assert f"{MAX_BYTES} bytes" in problem["detail"], problem
    await settled(rt)
    assert await registry_counts(rt) == before
    assert await staged_objects(rt) == []
    # Exactly at the limit is accepted.
    r = await client.post(path, files={"file": ("exact.txt", exact, "text/plain")})
    assert r.status_code == 202, r.text


async def test_bad_file_uploads_get_clear_4xx_and_change_nothing(stack):
    """Forms and raw bodies that cannot be an upload each get a 4xx problem naming what is
    wrong — no file part, two files, an unknown field, metadata that is not a JSON object, a
    field given twice, an unsupported declared type (field or Content-Type), a urlencoded
    form, a raw body without a name, an empty or blank file, an unknown KB, a malformed
    multipart body, one cut short — and nothing is stored or staged."""
    rt, client, _base = stack
    kb = await create_kb(client, tag_ids=[f"t-{uid()}"])
    await settled(rt)
    before = await registry_counts(rt)
    path = f"/v1/kbs/{kb['kb_id']}/documents"
    text = ("notes.txt", b"some notes", "text/plain")
    form_cases: list[tuple[dict[str, Any], dict[str, Any], int, str]] = [
        ({"name": (None, b"notes.txt")}, {}, 422, "file"),  # fields, no file part
        ({"file": text, "other": text}, {}, 422, "other"),
        ({"file": text}, {"colour": "red"}, 422, "colour"),
        ({"file": text}, {"metadata": "{not json"}, 422, "metadata"),
        ({"file": text}, {"metadata": "[1, 2]"}, 422, "metadata"),
        ({"file": text}, {"collection": ["a", "b"]}, 422, "collection"),
        ({"file": text}, {"mime_type": "audio/mpeg"}, 422, "mime_type"),
        ({"file": text}, {"content": "x"}, 422, "content"),
        ({"file": text}, {"tags": "collection:x"}, 422, "tags"),
        ({"file": ("empty.txt", b"", "text/plain")}, {}, 422, "file"),
        ({"file": ("blank.txt", b" \n\t ", "text/plain")}, {}, 422, "file"),
    ]
    for files, data, status, field in form_cases:
        r = await client.post(path, files=files, data=data)
        assert r.status_code == status, (files.keys(), data, r.text[:300])
        problem = r.json()
        assert problem["detail"] and r.headers["content-type"].startswith(
            "application/problem+json"
        )
        assert field in {problem.get("field")} | {e["field"] for e in problem.get("errors", [])}, (
            field,
            problem,
        )
    # A form cut short: the file's part never closes, so what came is not the whole file.
    cut = (
        b'--cut\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n\r\n'
        b"the first half of a file"
    )
    r = await client.post(
        path, content=cut, headers={"Content-Type": "multipart/form-data; boundary=cut"}
    )
    assert r.status_code == 422 and "closing boundary" in r.json()["detail"], r.text
    raw_cases: list[tuple[str, dict[str, Any], dict[str, str], int, str | None]] = [
        (path, {"name": "a.mp3"}, {"Content-Type": "audio/mpeg"}, 415, None),
        (path, {"name": "a"}, {"Content-Type": "application/x-www-form-urlencoded"}, 415, None),
        (path, {}, {"Content-Type": "text/plain"}, 422, "name"),
        (path, {"name": "a.txt", "colour": "red"}, {"Content-Type": "text/plain"}, 422, "colour"),
        (
            "/v1/kbs/no-such-kb/documents",
            {"name": "a.txt"},
            {"Content-Type": "text/plain"},
            404,
            "kb_id",
        ),
        (
            path,
            {"name": "a.txt"},
            {"Content-Type": "multipart/form-data; boundary=x"},
            422,
            None,
        ),
    ]
    for target, params, headers, status, field in raw_cases:
        r = await client.post(target, params=params, content=b"x" * 10, headers=headers)
        assert r.status_code == status, (params, headers, r.text[:300])
        problem = r.json()
        assert problem["detail"], problem
        if field:
            fields = {problem.get("field")} | {e["field"] for e in problem.get("errors", [])}
            assert field in fields, (field, problem)
    await settled(rt)
    assert await registry_counts(rt) == before
    assert await staged_objects(rt) == []
