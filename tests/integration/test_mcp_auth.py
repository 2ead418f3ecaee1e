"""API keys over MCP (streamable HTTP) and the tools REST surface: a key maps to its org, and
a key limited to some KBs and to read-only is confined by every tool, listing included."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import httpx
import pytest

from tests.conftest import running_stack
from tests.support.bus import OperatorKeys
from tests.support.corpus import DOCS, PARAPHRASES
from tests.support.mcp_client import failed, http_session, ok, serve_http


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    """Two KBs (tag_ids tag-mine / tag-other) with one document each, created before any key
    exists (loopback, no auth); then an unscoped admin key, and a read-only and a writable key
    limited to the first KB."""
    async with (
        running_stack(
            tmp_path_factory.mktemp("mcp-auth"), embedders=embedders, mcp_toolsets="core,compat"
        ) as (rt, client),
        serve_http(rt) as (base, _app),
    ):
        async with http_session(base) as session:
            kbs, docs = {}, {}
            for label, name in (("mine", "volcanoes.md"), ("other", "sourdough.md")):
                name_ = f"{label}-{uuid.uuid4().hex[:6]}"
                kb = ok(
                    await session.call_tool(
                        "kb_create", {"name": name_, "tag_ids": [f"tag-{label}"]}
                    )
                )
                doc = ok(
                    await session.call_tool(
                        "kb_upload",
                        {
                            "kb": kb["kb_id"],
                            "name": name,
                            "content": DOCS[name],
                            "source_id": f"src-{label}",
                        },
                    )
                )
                kbs[label], docs[label] = kb, doc
        keys = OperatorKeys(rt)
        admin = await keys.create(rt.settings.default_org, "admin")
        scoped = await keys.create(
            rt.settings.default_org, "agent", kb_ids=[kbs["mine"]["kb_id"]], read_only=True
        )
        writer = await keys.create(rt.settings.default_org, "writer", kb_ids=[kbs["mine"]["kb_id"]])
        yield SimpleNamespace(
            rt=rt,
            client=client,
            base=base,
            kbs=kbs,
            docs=docs,
            admin=admin,
            scoped=scoped,
            writer=writer,
        )


async def test_missing_or_unknown_key_is_refused_before_any_session(stack):
    """Once keys exist, /mcp answers 401 (with WWW-Authenticate) to a request without a key or
    with an unknown one, and POST /api/v1/tools/<name> answers the structured 401 error."""
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
    accept = {"Accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient(timeout=30) as http:
        for auth in ({}, {"Authorization": "Bearer kbm_nope"}, {"Authorization": "Basic x"}):
            r = await http.post(f"{stack.base}/mcp", json=init, headers={**accept, **auth})
            assert r.status_code == 401, r.text
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert r.json()["error_type"] == "Unauthorized" and r.json()["status"] == "error"
        r = await http.post(
            f"{stack.base}/mcp",
            json=init,
            headers={**accept, "Authorization": f"Bearer {stack.admin}"},
        )
        assert r.status_code == 200
    r = await stack.client.post("/api/v1/tools/kb_list", json={})
    assert r.status_code == 401 and r.json()["error_type"] == "Unauthorized"


async def test_scoped_read_only_key_searches_its_kb_and_nothing_else(stack):
    """A key limited to one KB and read-only: kb_list, kb_list_documents and every search
    tool show only its KB; searching, reading or deleting in another KB, and any upload or
    change, fail with a clear NotFound or Forbidden; nothing outside changes."""
    mine, other = stack.kbs["mine"], stack.kbs["other"]
    my_doc, other_doc = stack.docs["mine"]["document_id"], stack.docs["other"]["document_id"]
    async with http_session(stack.base, stack.scoped) as s:
        hits = ok(
            await s.call_tool(
                "kb_search", {"kb": mine["name"], "query": PARAPHRASES["volcanoes.md"]}
            )
        )["hits"]
        assert hits[0]["document_id"] == my_doc

        # Listing and unscoped searches see only the key's KB.
        listed = ok(await s.call_tool("kb_list", {}))
        assert [k["kb_id"] for k in listed["items"]] == [mine["kb_id"]]
        docs = ok(await s.call_tool("kb_list_documents", {}))
        assert [d["document_id"] for d in docs["items"]] == [my_doc]
        everywhere = ok(await s.call_tool("kb_search", {"query": PARAPHRASES["sourdough.md"]}))
        assert {h["kb_id"] for h in everywhere["hits"]} == {mine["kb_id"]}
        assert everywhere["kb_ids"] == [mine["kb_id"]]
        kb_wide = ok(
            await s.call_tool("search_knowledge_base", {"query": PARAPHRASES["sourdough.md"]})
        )
        assert {r["source"] for r in kb_wide["results"]} == {"volcanoes.md"}
        assert kb_wide["sources_searched"] == 1
        managed = ok(
            await s.call_tool(
                "manageKnowledge", {"operation": "search", "query": PARAPHRASES["sourdough.md"]}
            )
        )
        assert {c["sourceId"] for c in managed["chunks"]} == {"src-mine"}

        # Another KB, by any tool, is simply not there.
        for tool, args in (
            ("kb_search", {"kb": other["name"], "query": "bread"}),
            ("kb_stats", {"kb": other["kb_id"]}),
            ("kb_list_documents", {"kb": other["kb_id"]}),
            ("kb_upload", {"kb": other["kb_id"], "name": "x.md", "content": "x"}),
            ("upload_document", {"projectId": other["kb_id"], "fileName": "x", "content": "x"}),
            # manageKnowledge ingests into the default KB, which is outside this key's scope.
            ("manageKnowledge", {"operation": "ingest", "content": "x", "uri": "u"}),
        ):
            body = failed(await s.call_tool(tool, args), "NotFound")
            assert "not found" in body["message"], (tool, body)
        missing = failed(
            await s.call_tool("search_docs", {"query": "bread", "projectId": other["kb_id"]})
        )
        assert "project" in missing["message"] and "not found" in missing["message"]
        other_chunk = await _a_chunk_of(stack, other["kb_id"])
        failed(await s.call_tool("kb_get_chunk", {"chunk_id": other_chunk}), "NotFound")
        assert ok(await s.call_tool("kb_delete", {"document_id": other_doc}))["deleted_count"] == 0
        assert (
            ok(await s.call_tool("kb_delete_source", {"source_id": "src-other"}))["deleted_count"]
            == 0
        )

        # Its own KB is read-only.
        for tool, args in (
            ("kb_upload", {"kb": mine["kb_id"], "name": "x.md", "content": "x"}),
            ("kb_delete", {"document_id": my_doc}),
            ("delete_document", {"filepath": my_doc}),
            ("kb_set_collection", {"document_id": my_doc, "collection": "c"}),
            ("kb_update_document", {"document_id": my_doc, "tags": ["t"]}),
            ("kb_update", {"kb": mine["kb_id"], "description": "x"}),
            ("kb_reindex", {"kb": mine["kb_id"]}),
            ("kb_delete_source", {"source_id": "src-mine"}),
            ("kb_create", {"name": "new-kb"}),
        ):
            body = failed(await s.call_tool(tool, args), "Forbidden")
            assert "read-only" in body["message"] or "limited" in body["message"], (tool, body)

    # The same confinement through REST, with the key as a bearer token.
    headers = {"Authorization": f"Bearer {stack.scoped}"}
    r = await stack.client.post("/api/v1/tools/kb_list", json={}, headers=headers)
    assert [k["kb_id"] for k in r.json()["items"]] == [mine["kb_id"]]
    r = await stack.client.post(
        "/api/v1/tools/kb_delete", json={"document_id": my_doc}, headers=headers
    )
    assert r.status_code == 403 and r.json()["error_type"] == "Forbidden"

    # Nothing outside the scope (or inside it) changed.
    async with http_session(stack.base, stack.admin) as admin:
        docs = ok(await admin.call_tool("kb_list_documents", {}))
        assert {d["document_id"] for d in docs["items"]} >= {my_doc, other_doc}
        assert ok(await admin.call_tool("kb_stats", {"kb": other["kb_id"]}))["document_count"] == 1


async def test_admin_key_reaches_every_kb_of_its_org(stack):
    """An unscoped key sees both KBs and can search and write in either."""
    async with http_session(stack.base, stack.admin) as s:
        names = {k["kb_id"] for k in ok(await s.call_tool("kb_list", {}))["items"]}
        assert {stack.kbs["mine"]["kb_id"], stack.kbs["other"]["kb_id"]} <= names
        hits = ok(
            await s.call_tool(
                "kb_search",
                {"kb": stack.kbs["other"]["name"], "query": PARAPHRASES["sourdough.md"]},
            )
        )["hits"]
        assert hits[0]["document_id"] == stack.docs["other"]["document_id"]
        done = ok(
            await s.call_tool(
                "kb_upload",
                {"kb": stack.kbs["other"]["kb_id"], "name": "tcp.md", "content": DOCS["tcp.md"]},
            )
        )
        assert done["status"] == "complete"
        ok(await s.call_tool("kb_delete", {"document_id": done["document_id"]}))


async def _a_chunk_of(stack, kb_id: str) -> str:
    async with http_session(stack.base, stack.admin) as admin:
        hits = ok(await admin.call_tool("kb_search", {"kb": kb_id, "query": "bread"}))["hits"]
    return hits[0]["chunk_id"]


async def test_scoped_writable_key_cannot_tag_documents_out_of_its_scope(stack):
    """A writable key limited to one KB uploads and re-tags inside it, but tags that would
    make a document join a KB outside its scope are refused (Forbidden, KB not named), on
    upload and on kb_update_document alike."""
    mine = stack.kbs["mine"]
    async with http_session(stack.base, stack.writer) as s:
        done = ok(
            await s.call_tool(
                "kb_upload",
                {
                    "kb": mine["kb_id"],
                    "name": "tcp.md",
                    "content": DOCS["tcp.md"],
                    "tags": ["tag-mine", "plain"],
                },
            )
        )
        assert done["status"] == "complete" and done["kb_ids"] == [mine["kb_id"]]
        body = failed(
            await s.call_tool(
                "kb_upload",
                {"kb": mine["kb_id"], "name": "x.md", "content": "x", "tags": ["tag-other"]},
            ),
            "Forbidden",
        )
        assert stack.kbs["other"]["name"] not in body["message"]
        failed(
            await s.call_tool(
                "kb_update_document", {"document_id": done["document_id"], "tags": ["tag-other"]}
            ),
            "Forbidden",
        )
        view = ok(
            await s.call_tool(
                "kb_update_document", {"document_id": done["document_id"], "tags": ["renamed"]}
            )
        )
        assert "renamed" in view["tags"]
        ok(await s.call_tool("kb_delete", {"document_id": done["document_id"]}))
    async with http_session(stack.base, stack.admin) as admin:
        assert (
            ok(await admin.call_tool("kb_stats", {"kb": stack.kbs["other"]["kb_id"]}))[
                "document_count"
            ]
            == 1
        )
