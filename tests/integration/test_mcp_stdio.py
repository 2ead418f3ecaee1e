"""`kbmesh mcp` over stdio, driven by the official MCP client: as a subprocess connected to a
running stack (this process's, through its NATS URL), and with `--embedded` running the
whole stack inside the stdio process."""

from __future__ import annotations

import socket
import subprocess
import sys
from urllib.parse import urlparse

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError
from mcp_types.version import KNOWN_PROTOCOL_VERSIONS, LATEST_PROTOCOL_VERSION

from services.gateway.tools import TOOLS
from tests.conftest import running_stack
from tests.support.bus import OperatorKeys, bus_env
from tests.support.corpus import DOCS, PARAPHRASES
from tests.support.mcp_client import (
    OFFLINE_ENV,
    REPO,
    failed,
    http_session,
    kbmesh_command,
    ok,
    serve_http,
    stdio_session,
)
from tests.support.procs import kbmesh_env


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    async with running_stack(tmp_path_factory.mktemp("mcp-stdio"), embedders=embedders) as s:
        yield s


async def test_stdio_against_a_running_stack(stack, tmp_path):
    """A `kbmesh mcp` subprocess pointed at a running stack's NATS URL lists both toolsets,
    uploads (visible through REST), searches, answers bad input with a structured error and
    keeps serving, and deletes (gone from REST). Its logs never reach stdout, or the protocol
    would break."""
    rt, client = stack
    env = {
        **bus_env(rt),
        "KBMESH_MCP_TOOLSETS": "core,compat",
        "KBMESH_DATA_DIR": str(tmp_path),
        "KBMESH_LOG_LEVEL": "INFO",
    }
    with open(tmp_path / "stderr.log", "w") as errlog:
        async with stdio_session([], env, errlog) as s:
            assert {t.name for t in (await s.list_tools()).tools} == set(TOOLS)
            up = ok(
                await s.call_tool(
                    "kb_upload", {"name": "volcanoes.md", "content": DOCS["volcanoes.md"]}
                )
            )
            assert up["status"] == "complete"
            r = await client.get(f"/v1/documents/{up['document_id']}")
            assert r.status_code == 200 and r.json()["name"] == "volcanoes.md"
            found = await s.call_tool("kb_search", {"query": PARAPHRASES["volcanoes.md"]})
            assert ok(found)["hits"][0]["document_id"] == up["document_id"]
            # The cited document is linked, listed and read as a resource.
            uri = f"kbmesh://documents/{up['document_id']}"
            assert [c.uri for c in found.content if c.type == "resource_link"][:1] == [uri]
            assert uri in {r.uri for r in (await s.list_resources()).resources}
            read = (await s.read_resource(uri)).contents[0]
            assert read.text.strip() == DOCS["volcanoes.md"].strip()
            failed(await s.call_tool("kb_search", {"query": ""}), "ValidationError")
            failed(
                await s.call_tool(
                    "upload_document", {"projectId": "nope", "fileName": "a", "content": "x"}
                ),
                "NotFound",
            )
            gone = ok(await s.call_tool("delete_document", {"filepath": up["document_id"]}))
            assert gone["deleted_count"] == 1
    assert (await client.get(f"/v1/documents/{up['document_id']}")).status_code == 404
    assert "mcp_stdio_ready" in (tmp_path / "stderr.log").read_text()


@pytest.mark.parametrize(
    ("mode", "revision"),
    [("auto", LATEST_PROTOCOL_VERSION), ("legacy", KNOWN_PROTOCOL_VERSIONS[-2])],
)
async def test_stdio_serves_the_newest_revision_and_the_one_before(stack, tmp_path, mode, revision):
    """Over stdio, the official client negotiates the SDK's newest protocol revision by
    default and the previous one when it asks for it; on each, tools and resources answer."""
    rt, _ = stack
    command, *prefix = kbmesh_command()
    params = StdioServerParameters(
        command=command,
        args=[*prefix, "mcp"],
        cwd=str(REPO),
        env={
            **OFFLINE_ENV,
            **bus_env(rt),
            "PYTHONPATH": str(REPO),
            "KBMESH_DATA_DIR": str(tmp_path),
            "KBMESH_LOG_LEVEL": "WARNING",
        },
    )
    async with Client(params, mode=mode, read_timeout_seconds=180) as client:
        assert client.protocol_version == revision
        assert "items" in ok(await client.call_tool("kb_list", {}))
        listed = (await client.list_resources()).resources
        assert "kbmesh://kbs/default" in {r.uri for r in listed}
        page = (await client.read_resource("kbmesh://kbs/default")).contents[0]
        assert page.text.startswith("# default\n")


async def test_stdio_api_key_confines_the_process(stack, tmp_path):
    """`kbmesh mcp` with KBMESH_API_KEY runs as that key: a KB-scoped read-only key lists only
    its KB and cannot upload."""
    rt, client = stack
    kb = (await client.post("/v1/kbs", json={"name": "stdio-scope"})).json()
    key = await OperatorKeys(rt).create(
        rt.settings.default_org, "stdio", kb_ids=[kb["kb_id"]], read_only=True
    )
    env = {**bus_env(rt), "KBMESH_API_KEY": key, "KBMESH_DATA_DIR": str(tmp_path)}
    async with stdio_session([], env) as s:
        listed = ok(await s.call_tool("kb_list", {}))
        assert [k["kb_id"] for k in listed["items"]] == [kb["kb_id"]]
        resources = (await s.list_resources()).resources
        assert [r.uri for r in resources] == [f"kbmesh://kbs/{kb['kb_id']}"]
        with pytest.raises(MCPError, match="not found"):
            await s.read_resource("kbmesh://kbs/default")
        failed(
            await s.call_tool("kb_upload", {"kb": kb["kb_id"], "name": "a", "content": "x"}),
            "Forbidden",
        )


async def test_stdio_relays_to_a_stack_reached_over_http_only(stack, tmp_path):
    """`kbmesh mcp --api URL` (no NATS, no data directory: a stack on another machine) serves
    the stack's own tools over stdio with the key it is given: the same list, uploads and
    searches that REST sees, the stack's structured errors, and the key's scope."""
    rt, client = stack
    keys = OperatorKeys(rt)
    admin = await keys.create(rt.settings.default_org, "relay admin")
    auth = {"Authorization": f"Bearer {admin}"}
    async with serve_http(rt) as (base, _app):
        env = {"KBMESH_DATA_DIR": str(tmp_path / "nothing-here"), "KBMESH_API_KEY": admin}
        async with stdio_session(["--api", base], env) as s:
            assert {t.name for t in (await s.list_tools()).tools} == {
                t.name for t in await _remote_tools(base, admin)
            }
            up = ok(
                await s.call_tool(
                    "kb_upload", {"name": "relay.md", "content": DOCS["volcanoes.md"]}
                )
            )
            assert up["status"] == "complete"
            r = await client.get(f"/v1/documents/{up['document_id']}", headers=auth)
            assert r.status_code == 200, r.text
            hits = ok(await s.call_tool("kb_search", {"query": PARAPHRASES["volcanoes.md"]}))
            assert up["document_id"] in {h["document_id"] for h in hits["hits"]}
            failed(await s.call_tool("kb_search", {"query": ""}), "ValidationError")
            # Resources are the stack's too: listed, templated and read through the relay.
            uri = f"kbmesh://documents/{up['document_id']}"
            assert uri in {r.uri for r in (await s.list_resources()).resources}
            templates = (await s.list_resource_templates()).resource_templates
            assert len(templates) == 2
            read = (await s.read_resource(uri)).contents[0]
            assert read.text.strip() == DOCS["volcanoes.md"].strip()

        kb = (await client.post("/v1/kbs", json={"name": "relay-scope"}, headers=auth)).json()
        scoped = await keys.create(
            rt.settings.default_org, "relay", kb_ids=[kb["kb_id"]], read_only=True
        )
        async with stdio_session(["--api", base], {**env, "KBMESH_API_KEY": scoped}) as s:
            listed = ok(await s.call_tool("kb_list", {}))
            assert [k["kb_id"] for k in listed["items"]] == [kb["kb_id"]]
            failed(
                await s.call_tool("kb_upload", {"kb": kb["kb_id"], "name": "a", "content": "x"}),
                "Forbidden",
            )
            with pytest.raises(MCPError, match="not found"):
                await s.read_resource(f"kbmesh://documents/{up['document_id']}")
    assert not (tmp_path / "nothing-here").exists()


async def _remote_tools(base: str, key: str) -> list:
    async with http_session(base, key) as session:
        return (await session.list_tools()).tools


async def test_stdio_embedded_runs_the_whole_stack(tmp_path):
    """`kbmesh mcp --embedded` starts its own NATS, engine and model inside the stdio
    process: an upload is searchable by a paraphrase; when the client closes, the process
    exits and takes its nats-server with it."""
    data = tmp_path / "data"
    with open(tmp_path / "stderr.log", "w") as errlog:
        async with stdio_session(["--embedded"], {"KBMESH_DATA_DIR": str(data)}, errlog) as s:
            for name in ("tcp.md", "sourdough.md"):
                up = ok(await s.call_tool("kb_upload", {"name": name, "content": DOCS[name]}))
                assert up["status"] == "complete", up
            hits = ok(await s.call_tool("kb_search", {"query": PARAPHRASES["tcp.md"]}))
            assert hits["hits"][0]["document_name"] == "tcp.md"
    url = urlparse((data / "nats.url").read_text().strip())
    with pytest.raises(OSError), socket.create_connection((url.hostname, url.port), timeout=1):
        pass


def test_stdio_without_a_running_stack_says_how_to_start_one(tmp_path):
    """Without KBMESH_NATS_URL, a recorded `kbmesh up` URL or --embedded, `kbmesh mcp` exits
    non-zero with a message on stderr naming the three ways, and writes nothing to stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "mcp"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=kbmesh_env(KBMESH_DATA_DIR=str(tmp_path)),
    )
    assert proc.returncode != 0
    assert proc.stdout == ""
    for hint in ("KBMESH_NATS_URL", "kbmesh up", "--embedded"):
        assert hint in proc.stderr, proc.stderr


def test_stdio_embedded_refuses_a_data_dir_in_use(stack):
    """`kbmesh mcp --embedded` on the data directory of a running kbmesh exits with a message
    pointing to `kbmesh mcp` instead of opening the same store twice."""
    rt, _ = stack
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "mcp", "--embedded"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=kbmesh_env(KBMESH_DATA_DIR=str(rt.settings.data_dir)),
    )
    assert proc.returncode != 0 and proc.stdout == ""
    assert "already running" in proc.stderr and "without --embedded" in proc.stderr
