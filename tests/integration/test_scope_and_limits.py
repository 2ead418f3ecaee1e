"""Hardening of the gateway edge against the real stack, over REST and MCP: KB-scoped keys
stay inside their scope (no replacing, probing or pulling in documents of other KBs), KB
models are checked before a KB is saved, outbound calls follow the egress policy, document
limits answer 413/422 before anything is stored, and concurrent writes are never silently
lost."""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace

import httpx
import pytest

from tests.conftest import running_stack
from tests.support.bus import OperatorKeys
from tests.support.domain import create_kb, object_count, registry_counts, settled, uid
from tests.support.mcp_client import failed, http_session, serve_http
from tests.support.openai_embeddings import OpenAIEmbeddingsServer

KB_LIMIT = 12
REMOTE = "openai/test-embed"


@pytest.fixture(scope="module")
def provider():
    with pytest.MonkeyPatch.context() as mp, OpenAIEmbeddingsServer(dim=8) as server:
        mp.setenv("OPENAI_API_KEY", "test")
        yield server


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    """Two KBs, `mine` and `theirs`, with a document each; a writable key limited to
    `mine`, a read-only key of another org. No egress allow-list: loopback is refused."""
    async with (
        running_stack(
            tmp_path_factory.mktemp("hardening"), embedders=embedders, kb_limit=KB_LIMIT
        ) as (rt, client),
        serve_http(rt) as (base, _app),
    ):
        mine, theirs = await create_kb(client, name="mine"), await create_kb(client, name="theirs")
        docs = {}
        for label, kb in (("mine", mine), ("theirs", theirs)):
            r = await client.post(
                f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
                json={
                    "name": f"{label}.txt",
                    "content": f"the {label} team keeps its plans here",
                    "tags": [f"shared-{label}", "common"],
                },
            )
            assert r.json()["status"] == "complete", r.text
            docs[label] = r.json()
        keys = OperatorKeys(rt)
        writer = await keys.create(rt.settings.default_org, "writer", kb_ids=[mine["kb_id"]])
        admin = await keys.create(rt.settings.default_org, "admin")
        # With keys, every request needs one: the org-wide key unless a test says otherwise.
        client.headers["Authorization"] = f"Bearer {admin}"
        reader = await keys.create(f"ro-{uid()}", "reader", read_only=True)
        yield SimpleNamespace(
            rt=rt,
            client=client,
            base=base,
            mine=mine,
            theirs=theirs,
            docs=docs,
            writer={"Authorization": f"Bearer {writer}"},
            writer_key=writer,
            reader={"Authorization": f"Bearer {reader}"},
        )


# ---- scope ---------------------------------------------------------------------------------


async def test_a_scoped_key_cannot_replace_a_document_it_cannot_read(stack):
    """Uploading into its own KB with the id of a document in another KB answers 409 with
    the words used for any unavailable id (no revision, no name) and leaves the document as
    it was; the same over MCP's kb_upload. Its own document can be replaced."""
    client, theirs = stack.client, stack.docs["theirs"]
    r = await client.post(
        f"/v1/kbs/{stack.mine['kb_id']}/documents?wait=true",
        headers=stack.writer,
        json={"name": "x.txt", "content": "hijacked", "document_id": theirs["document_id"]},
    )
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["field"] == "document_id"
    assert body["detail"] == (
        f"document_id {theirs['document_id']!r} is not available; choose another id"
    )
    assert "revision" not in body and "theirs" not in r.text
    async with http_session(stack.base, stack.writer_key) as s:
        failed(
            await s.call_tool(
                "kb_upload",
                {
                    "kb": stack.mine["kb_id"],
                    "name": "x.txt",
                    "content": "hijacked",
                    "document_id": theirs["document_id"],
                },
            ),
            "Conflict",
        )
    await settled(stack.rt)
    view = (await client.get(f"/v1/documents/{theirs['document_id']}")).json()
    assert view["name"] == "theirs.txt" and view["revision"] == theirs["revision"]
    assert view["kb_ids"] == [stack.theirs["kb_id"]]
    r = await client.post(
        f"/v1/kbs/{stack.mine['kb_id']}/documents?wait=true",
        headers=stack.writer,
        json={"name": "mine2.txt", "content": "ours", "document_id": f"own-{uid()}"},
    )
    assert r.status_code == 200 and r.json()["status"] == "complete", r.text


async def test_a_scoped_key_cannot_give_its_kb_tags_that_pull_in_other_kbs_documents(stack):
    """tag_ids `kb:<theirs>`, a tag carried by a document of another KB, and even a tag only
    its own documents carry today (others may carry it tomorrow) are refused (403, field
    tag_ids) over REST and MCP's kb_update, and the KB still holds only its own documents;
    its own KB's tag, and removing tags, are fine."""
    client, mine = stack.client, stack.mine
    for tags in ([f"kb:{stack.theirs['kb_id']}"], ["shared-theirs"], ["common"], ["shared-mine"]):
        r = await client.patch(
            f"/v1/kbs/{mine['kb_id']}", headers=stack.writer, json={"tag_ids": tags}
        )
        assert r.status_code == 403, (tags, r.text)
        assert r.json()["field"] == "tag_ids"
    async with http_session(stack.base, stack.writer_key) as s:
        failed(
            await s.call_tool(
                "kb_update", {"kb": mine["kb_id"], "tag_ids": [f"kb:{stack.theirs['kb_id']}"]}
            ),
            "Forbidden",
        )
    r = await client.patch(
        f"/v1/kbs/{mine['kb_id']}", headers=stack.writer, json={"tag_ids": [f"kb:{mine['kb_id']}"]}
    )
    assert r.status_code == 200, r.text
    r = await client.patch(f"/v1/kbs/{mine['kb_id']}", headers=stack.writer, json={"tag_ids": []})
    assert r.status_code == 200, r.text
    await settled(stack.rt)
    listed = (await client.get("/v1/documents", headers=stack.writer)).json()["items"]
    assert stack.docs["theirs"]["document_id"] not in {d["document_id"] for d in listed}


async def test_a_scoped_key_sees_no_ids_of_kbs_outside_its_scope(stack):
    """A document in both KBs shows the scoped key only its own KB in kb_ids and tags, in
    the document view and in search hits."""
    client = stack.client
    r = await client.post(
        "/v1/documents?wait=true",
        json={
            "name": "both.txt",
            "content": "a note about glaciers filed in both knowledge bases",
            "tags": [f"kb:{stack.mine['kb_id']}", f"kb:{stack.theirs['kb_id']}"],
        },
    )
    doc = r.json()["document_id"]
    view = (await client.get(f"/v1/documents/{doc}", headers=stack.writer)).json()
    assert view["kb_ids"] == [stack.mine["kb_id"]]
    assert stack.theirs["kb_id"] not in str(view["tags"])
    hits = (
        await client.post("/v1/search", headers=stack.writer, json={"query": "glaciers note"})
    ).json()["hits"]
    assert hits and all(stack.theirs["kb_id"] not in str(h["tags"]) for h in hits)


async def test_a_read_only_key_does_not_create_the_default_kb(stack):
    """GET of the default KB by a read-only key of a new org is a 404 and creates nothing."""
    before = len(await stack.rt.registries.kbs.list())
    r = await stack.client.get("/v1/kbs/default", headers=stack.reader)
    assert r.status_code == 404, r.text
    r = await stack.client.get("/v1/documents?kb=default", headers=stack.reader)
    assert r.status_code == 404, r.text
    assert len(await stack.rt.registries.kbs.list()) == before


# ---- models and outbound calls -------------------------------------------------------------


async def test_kb_models_are_checked_before_the_kb_is_saved(stack, provider):
    """A loopback api_base is refused by the egress policy (403, field api_base) before any
    request reaches it; with the address allowed, a provider that rejects the model gives a
    422 naming embedding_model, an unreachable one names api_base, and one that answers is
    accepted after one probe request. The same checks apply to PATCH."""
    client, rt = stack.client, stack.rt
    before = provider.requests
    r = await client.post(
        "/v1/kbs",
        json={"name": f"r-{uid()}", "embedding_model": REMOTE, "api_base": provider.base_url},
    )
    assert r.status_code == 403 and r.json()["field"] == "api_base", r.text
    assert provider.requests == before
    rt.settings.egress.allowlist = ["127.0.0.1"]
    try:
        provider.fail_next(1, status=404, message="SECRET no such model")
        r = await client.post(
            "/v1/kbs",
            json={
                "name": f"r-{uid()}",
                "embedding_model": "openai/text-embeding-3-smal",
                "api_base": provider.base_url,
            },
        )
        assert r.status_code == 422 and r.json()["field"] == "embedding_model", r.text
        assert "SECRET" not in r.text
        dead = OpenAIEmbeddingsServer().start()
        dead.stop()
        r = await client.post(
            "/v1/kbs",
            json={"name": f"r-{uid()}", "embedding_model": REMOTE, "api_base": dead.base_url},
        )
        assert r.status_code == 422 and r.json()["field"] == "api_base", r.text
        r = await client.post(
            "/v1/kbs",
            json={"name": f"r-{uid()}", "embedding_model": REMOTE, "api_base": provider.base_url},
        )
        assert r.status_code == 201, r.text
        kb = r.json()
        provider.fail_next(1, status=400)
        r = await client.patch(f"/v1/kbs/{kb['kb_id']}", json={"embedding_model": "openai/other"})
        assert r.status_code == 422 and r.json()["field"] == "embedding_model", r.text
    finally:
        rt.settings.egress.allowlist = []
    r = await client.patch(f"/v1/kbs/{kb['kb_id']}", json={"api_base": "http://169.254.169.254/v1"})
    assert r.status_code == 403 and r.json()["field"] == "api_base", r.text
    r = await client.patch(f"/v1/kbs/{stack.mine['kb_id']}", json={"embedding_model": "local/nope"})
    assert r.status_code == 422, r.text


# ---- limits --------------------------------------------------------------------------------


async def test_document_limits_answer_413_or_422_and_store_nothing(stack):
    """Over-limit and malformed documents are refused at the edge with a problem body naming
    the field, and leave KBs, documents, objects and vectors as they were."""
    client, rt = stack.client, stack.rt
    await settled(rt)
    before = await registry_counts(rt)
    deep: dict = {}
    node = deep
    for _ in range(20):
        node["x"] = {}
        node = node["x"]
    base = {"name": "limits.txt", "content": "some text"}
    cases = [
        ({"tags": [f"t{i}" for i in range(101)]}, 422, "tags"),
        ({"tags": ["x" * 201]}, 422, "tags"),
        ({"tags": ["a\x00b"]}, 422, "tags"),
        ({"metadata": {"blob": "x" * 70_000}}, 413, "metadata"),
        ({"metadata": deep}, 422, "metadata"),
        ({"uri": "https://example.com/" + "a" * 3000}, 422, "uri"),
        ({"content": "nul\x00inside"}, 422, "content"),
        ({"content": "   \n\t  "}, 422, "content"),
        ({"name": "bad\x00name"}, 422, "name"),
    ]
    for extra, status, field in cases:
        r = await client.post("/v1/documents?wait=true", json={**base, **extra})
        assert r.status_code == status, (extra if len(str(extra)) < 200 else field, r.text[:300])
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["field"] == field, r.text[:300]
    await settled(rt)
    assert await registry_counts(rt) == before


async def test_lone_surrogates_and_deep_nesting_are_4xx_on_a_kept_connection(stack):
    """Over real HTTP: a lone surrogate in content, tags or a search filter, and metadata
    nested 300 deep, each answer a 422 problem body, and the same keep-alive connection then
    serves the next request."""
    deep = '{"x":' * 300 + "1" + "}" * 300
    bodies = [
        ("/v1/documents", '{"name": "s.txt", "content": "\\ud800"}'),
        ("/v1/documents", '{"name": "s.txt", "content": "ok", "tags": ["\\udfff"]}'),
        ("/v1/search", '{"query": "x", "filters": {"tags": ["\\ud800"]}}'),
        ("/v1/documents", '{"name": "s.txt", "content": "ok", "metadata": ' + deep + "}"),
    ]
    async with httpx.AsyncClient(
        base_url=stack.base, timeout=60, headers=stack.client.headers
    ) as http:
        for path, raw in bodies:
            r = await http.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 422, r.text
            assert r.headers["content-type"] == "application/problem+json"
            assert (await http.get("/v1/kbs")).status_code == 200


async def test_a_failed_waited_upload_is_a_4xx_and_leaves_no_staged_object(stack):
    """A large upload (over the inline limit, so staged in the object store) whose content
    ingest cannot read answers 422 with the reason, not 202; its staged object is removed."""
    client, rt = stack.client, stack.rt
    await settled(rt)
    objects = await object_count(rt)
    garbage = base64.b64encode(b"%PDF-1.4 not really" + b"\x01" * 400_000).decode()
    r = await client.post(
        "/v1/documents?wait=true",
        json={
            "name": "broken.pdf",
            "content": garbage,
            "content_encoding": "base64",
            "mime_type": "application/pdf",
        },
    )
    assert r.status_code == 422, r.text
    assert "PDF" in r.json()["detail"]
    await settled(rt)
    assert await object_count(rt) == objects


# ---- concurrency ---------------------------------------------------------------------------


async def test_concurrent_kb_creates_respect_the_limit(stack):
    """Many concurrent creates leave exactly the limit: the rest are 409."""
    client, rt = stack.client, stack.rt
    have = len(await rt.registries.kbs.list(f"{rt.settings.default_org}."))
    rs = await asyncio.gather(
        *(client.post("/v1/kbs", json={"name": f"c-{i}-{uid()}"}) for i in range(3 * KB_LIMIT))
    )
    assert sorted({r.status_code for r in rs}) == [201, 409]
    assert sum(r.status_code == 201 for r in rs) == KB_LIMIT - have
    assert len(await rt.registries.kbs.list(f"{rt.settings.default_org}.")) == KB_LIMIT
    for r in rs:
        if r.status_code == 201:
            assert (await client.delete(f"/v1/kbs/{r.json()['kb_id']}")).status_code == 200


@pytest.mark.parametrize("wait", ["false", "true"])
async def test_concurrent_patches_apply_in_order_or_answer_409(stack, wait):
    """Twenty concurrent PATCHes of one document's metadata: each answers 200 with its own
    change at its own revision, or 409; none is silently dropped, and the document ends with
    the change of the highest revision."""
    client = stack.client
    r = await client.post("/v1/documents?wait=true", json={"name": "p.txt", "content": "patch me"})
    doc = r.json()["document_id"]
    rs = await asyncio.gather(
        *(
            client.patch(f"/v1/documents/{doc}?wait={wait}", json={"metadata": {"n": i}})
            for i in range(20)
        )
    )
    assert {r.status_code for r in rs} <= {200, 409}, [r.text for r in rs if r.status_code >= 500]
    applied = {r.json()["revision"]: r.json()["metadata"]["n"] for r in rs if r.status_code == 200}
    won = [r for r in rs if r.status_code == 200]
    assert won and len(applied) == len(won)  # each at its own revision
    await settled(stack.rt)
    final = (await client.get(f"/v1/documents/{doc}")).json()
    assert final["metadata"] == {"n": applied[max(applied)]}
    assert final["revision"] == max(applied)


async def test_concurrent_waited_writes_to_one_document_each_answer(stack):
    """Four uploads and a PATCH of one document, all waiting, at once: every call answers
    well before the wait timeout, either with its own change (its own tags) or with 409;
    none answers 202."""
    client = stack.client
    doc = f"contended-{uid()}"
    into = f"/v1/kbs/{stack.mine['kb_id']}/documents?wait=true"
    r = await client.post(into, json={"name": "c.txt", "content": "start", "document_id": doc})
    assert r.status_code == 200

    async def put(i: int) -> httpx.Response:
        return await client.post(
            into,
            json={
                "name": f"c{i}.txt",
                "content": f"version {i}",
                "document_id": doc,
                "tags": [f"v{i}"],
            },
        )

    async def patch() -> httpx.Response:
        return await client.patch(f"/v1/documents/{doc}?wait=true", json={"tags": ["patched"]})

    rs = await asyncio.wait_for(asyncio.gather(*(put(i) for i in range(4)), patch()), 60)
    assert all(r.status_code in (200, 409) for r in rs), [(r.status_code, r.text) for r in rs]
    for r in rs[:4]:
        if r.status_code == 200:
            assert r.json()["status"] == "complete", r.text
    if rs[4].status_code == 200:
        tags = rs[4].json()["tags"]
        assert "patched" in tags and not any(t.startswith("v") for t in tags), tags
    assert any(r.status_code == 200 for r in rs)
