"""`kbmesh login` against a real OpenID provider (tests/oidc/) on loopback: the device grant
(RFC 8628) signs a person in, the token is kept owner-only, the REST commands use it (and
renew it when it has expired), and `kbmesh logout` forgets it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from services.common.bus.nats_server import free_port
from tests.conftest import running_stack
from tests.support.bus import OperatorKeys
from tests.support.corpus import DOCS
from tests.support.mcp_client import kbmesh_command, serve_http
from tests.support.oidc import PEOPLE_CLIENT, enter_device_code, oidc_provider, provider_missing

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(provider_missing() is not None, reason=provider_missing() or "")


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    """A provider on loopback whose people's client signs in to kbmesh; one KB in org acme
    holding one document, made by an API key."""
    tmp = tmp_path_factory.mktemp("login")
    accounts = tmp / "accounts.json"
    accounts.write_text(
        json.dumps({"alice": {"org": "acme", "email": "alice@example.com", "name": "Alice"}})
    )
    port, kb_port = free_port(), free_port()
    issuer = f"http://127.0.0.1:{port}"
    oauth = {
        "issuer": issuer,
        "resource": f"http://127.0.0.1:{kb_port}/mcp",
        "org_claim": "org",
        "client_id": PEOPLE_CLIENT,
    }
    async with (
        oidc_provider(issuer, port, accounts, console_url=f"http://127.0.0.1:{kb_port}/"),
        running_stack(tmp / "data", embedders=embedders, oauth=oauth) as (rt, _client),
        serve_http(rt, port=kb_port) as (base, _app),
    ):
        admin = await OperatorKeys(rt).create("acme", "admin")
        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {admin}"}, timeout=120
        ) as http:
            response = await http.post("/v1/kbs", json={"name": f"login-{uuid.uuid4().hex[:6]}"})
            assert response.status_code == 201, response.text
            kb = response.json()
            response = await http.post(
                "/v1/documents",
                params={"wait": "true"},
                json={
                    "kb_id": kb["kb_id"],
                    "name": "volcanoes.md",
                    "content": DOCS["volcanoes.md"],
                },
            )
            assert response.status_code in (200, 201), response.text
        yield SimpleNamespace(base=base, issuer=issuer, kb=kb, document=response.json())


def cli_env(config: Path) -> dict[str, str]:
    """This tree's CLI with its own config dir and no API key."""
    env = {k: v for k, v in os.environ.items() if k != "KBMESH_API_KEY"}
    env |= {"XDG_CONFIG_HOME": str(config), "PYTHONPATH": str(REPO)}
    return env


async def kbmesh(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *kbmesh_command(),
        *args,
        env=env,
        cwd=str(REPO),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_login_by_device_code_then_rest_commands_use_the_token(stack, tmp_path):
    """`kbmesh login` prints the provider's page and a code; once alice enters it there and
    approves, it says she is signed in and keeps the token owner-only; `kbmesh status` and
    `kbmesh search` then work as her with no API key; an expired token is renewed with the
    refresh token; after `kbmesh logout` the token is gone and the server refuses."""
    env = cli_env(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        *kbmesh_command(),
        "login",
        "--api",
        stack.base,
        env=env,
        cwd=str(REPO),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode()
    shown = re.search(r"open (\S+) and enter the code (\S+)", line)
    assert shown is not None, line + (await proc.stderr.read()).decode()
    assert shown.group(1).startswith(stack.issuer)
    await enter_device_code(shown.group(1), shown.group(2), "alice")
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()
    assert "signed in" in out.decode() and "Alice <alice@example.com>" in out.decode()

    path = tmp_path / "kbmesh" / "token.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    stored = json.loads(path.read_text())
    assert stored["api"] == stack.base and stored["refresh_token"]

    code, out, err = await kbmesh(env, "status", "--api", stack.base)
    assert code == 0, err
    assert stack.kb["name"] in out
    code, out, err = await kbmesh(
        env, "search", "volcano", "--kb", stack.kb["kb_id"], "--api", stack.base, "--json"
    )
    assert code == 0, err
    assert json.loads(out)["hits"][0]["document_id"] == stack.document["document_id"]

    # Expired on this side: the next command renews it before sending it.
    path.write_text(json.dumps({**stored, "expires_at": 0}))
    code, out, err = await kbmesh(env, "kb", "list", "--api", stack.base)
    assert code == 0, err
    renewed = json.loads(path.read_text())
    assert renewed["access_token"] != stored["access_token"]
    assert renewed["expires_at"] > stored["expires_at"] - 1

    code, out, _ = await kbmesh(env, "logout")
    assert code == 0 and not path.exists()
    code, _, err = await kbmesh(env, "status", "--api", stack.base)
    assert code == 1 and "401" in err
