"""`kbmesh status`, `kbmesh search` and `kbmesh kb list|create|delete`, each run in its own
process against a real stack over HTTP, as a person at a terminal runs them."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.conftest import running_stack
from tests.support.cli import kbmesh
from tests.support.domain import uid
from tests.support.mcp_client import serve_http


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    async with (
        running_stack(tmp_path_factory.mktemp("cli-api"), embedders=embedders) as (rt, client),
        serve_http(rt) as (base, _app),
    ):
        yield client, base


async def test_kb_create_list_search_status_and_delete(stack: tuple[Any, str]) -> None:
    """A KB made with the server's defaults, listed, filled, searched (text and --json),
    shown by status, and deleted — all from the command line."""
    client, base = stack
    name = f"cli-{uid()}"
    code, out, err = await kbmesh("kb", "create", name, "--tags", "cli-notes", "--api", base)
    assert code == 0, err
    defaults = (await client.get("/v1/defaults")).json()["kb"]
    assert f"chunk size {defaults['chunk_size']}" in out

    r = await client.post(
        f"/v1/kbs/{name}/documents?wait=true",
        json={"name": "otters.md", "content": "Sea otters hold hands while they sleep."},
    )
    assert r.status_code in (200, 202), r.text

    code, out, err = await kbmesh("kb", "list", "--api", base)
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith(name))
    assert row.split()[1:3] == ["1", "1"]  # one document, one chunk

    code, out, err = await kbmesh("search", "do otters sleep", "--kb", name, "--api", base)
    assert code == 0, err
    assert out.startswith("1. otters.md") and "hold hands" in out
    code, out, _ = await kbmesh(
        "search", "otters", "--kb", name, "--mode", "keyword", "--json", "--api", base
    )
    assert json.loads(out)["hits"][0]["document_name"] == "otters.md"

    # The API's address from the environment, as scripts set it.
    code, out, err = await kbmesh("status", env={"KBMESH_API_URL": base})
    assert code == 0, err
    assert out.startswith(f"kbmesh at {base}: ready")
    assert any(line.startswith(name) for line in out.splitlines())
    assert "dead letters:" in out
    code, out, _ = await kbmesh("status", "--json", "--api", base)
    assert name in {k["name"] for k in json.loads(out)["knowledge_bases"]}

    code, out, err = await kbmesh("kb", "delete", name, "--api", base)
    assert code == 0, err
    assert (await client.get(f"/v1/kbs/{name}")).status_code == 404


async def test_errors_name_the_url_and_the_reason(stack: tuple[Any, str]) -> None:
    _client, base = stack
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _out, err = await kbmesh("status", env={"KBMESH_PORT": str(port)})
    assert code == 1
    assert f"cannot reach kbmesh at http://127.0.0.1:{port}" in err

    code, _out, err = await kbmesh("kb", "create", "x", "--chunk-size", "5000", "--api", base)
    assert code == 1
    assert "HTTP 422" in err and "chunk_size" in err
    code, _out, err = await kbmesh("search", "x", "--kb", f"missing-{uid()}", "--api", base)
    assert code == 1 and "HTTP 404" in err
