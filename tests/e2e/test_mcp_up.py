"""MCP as operators and desktop agents use it: `kbmesh up` as a subprocess, driven by the
official MCP client over streamable HTTP, and `kbmesh mcp` (stdio) finding that stack from
its data directory alone."""

from __future__ import annotations

import asyncio

from tests.support.corpus import DOCS, PARAPHRASES
from tests.support.mcp_client import http_session, ok, stdio_session
from tests.support.procs import Proc, free_port, kbmesh_env, wait_ready


async def test_up_serves_mcp_over_http_and_stdio_shares_it(tmp_path):
    """Over HTTP at /mcp, uploads index and paraphrases find them; a stdio `kbmesh mcp` given
    only KBMESH_DATA_DIR connects to the same stack through the NATS URL `kbmesh up`
    recorded, finds what HTTP uploaded (core and compat tools), and its delete is seen over
    HTTP."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    up = Proc(
        ["up", "--data-dir", str(data), "--port", str(port)],
        tmp_path / "up.log",
        kbmesh_env(KBMESH_MCP_TOOLSETS="core,compat"),
    )
    try:
        await asyncio.to_thread(wait_ready, base, up)
        async with http_session(base) as http:
            ids = {}
            for name, text in DOCS.items():
                done = ok(await http.call_tool("kb_upload", {"name": name, "content": text}))
                assert done["status"] == "complete", done
                ids[name] = done["document_id"]
            for name, query in PARAPHRASES.items():
                hits = ok(await http.call_tool("kb_search", {"query": query}))["hits"]
                assert hits[0]["document_id"] == ids[name], (query, hits)

        env = {"KBMESH_DATA_DIR": str(data), "KBMESH_MCP_TOOLSETS": "core,compat"}
        async with stdio_session([], env) as stdio:
            hits = ok(await stdio.call_tool("kb_search", {"query": PARAPHRASES["tcp.md"]}))
            assert hits["hits"][0]["document_id"] == ids["tcp.md"]
            docs = ok(
                await stdio.call_tool(
                    "search_docs",
                    {"query": PARAPHRASES["sourdough.md"], "projectId": "default", "minScore": 0.1},
                )
            )
            assert docs["results"][0]["documentTitle"] == "sourdough.md"
            gone = ok(await stdio.call_tool("kb_delete", {"document_id": ids["tcp.md"]}))
            assert gone["deleted_count"] == 1

        async with http_session(base) as http:
            left = ok(await http.call_tool("kb_list_documents", {}))
            assert {d["document_id"] for d in left["items"]} == {
                ids["volcanoes.md"],
                ids["sourdough.md"],
            }
    finally:
        assert up.stop() == 0, up.output()[-3000:]
