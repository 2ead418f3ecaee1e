"""kbmesh as an OAuth 2.1 resource server, against a real OpenID provider (panva/oidc-provider,
tests/oidc/) on loopback: the official MCP client signs in knowing only kbmesh's URL; tokens
for another audience, expired, or signed by another key are refused; scopes and KB claims
confine users; the user is the writer on the audit trail; API keys keep working beside."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import httpx
import httpx2
import pytest
from mcp import ClientSession
from mcp.client.auth import OAuthClientProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import (
    AuthorizationCodeResult,
    OAuthClientInformationFull,
    OAuthClientMetadata,
    OAuthToken,
)

from services.common.bus.nats_server import free_port
from services.gateway.oauth import SCOPES
from tests.conftest import running_stack
from tests.support.bus import OperatorKeys
from tests.support.corpus import DOCS
from tests.support.mcp_client import failed, ok, serve_http
from tests.support.oidc import oidc_provider, provider_missing

REDIRECT = "http://127.0.0.1:1/callback"  # never served: the test catches the code on its way

pytestmark = pytest.mark.skipif(provider_missing() is not None, reason=provider_missing() or "")


async def sign_in(authorization_url: str, user: str) -> dict[str, str]:
    """What a person does in the browser: follow the provider's pages, post its login and
    consent forms, and stop at the redirect back to the client; returns its parameters."""
    async with httpx.AsyncClient(timeout=30) as browser:
        url = authorization_url
        for _ in range(20):
            response = await browser.get(url)
            if response.status_code in (302, 303):
                url = urljoin(url, response.headers["location"])
            else:
                form = re.search(r'<form[^>]*action="([^"]+)"', response.text)
                assert form is not None, response.text[:500]
                action = urljoin(url, form.group(1))
                fields = {"prompt": "login", "login": user, "password": "any"}
                if 'name="login"' not in response.text:
                    fields = {"prompt": "consent"}
                response = await browser.post(action, data=fields)
                assert response.status_code in (302, 303), response.text[:500]
                url = urljoin(action, response.headers["location"])
            if url.startswith(REDIRECT):
                back = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
                assert "code" in back, f"the provider refused: {back}"
                return back
    raise AssertionError("the provider never redirected back with a code")


async def token_for(
    issuer: str, user: str, resource: str, scope: str, client_id: str = "kbmesh-test"
) -> str:
    """An access token from the provider by authorization code + PKCE, as any client gets one."""
    verifier = uuid.uuid4().hex * 2

    challenge = (
        base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
    )
    query = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": REDIRECT,
        "scope": scope,
        "resource": resource,
        "state": "s",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    back = await sign_in(f"{issuer}/auth?{urlencode(query)}", user)
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"{issuer}/token",
            data={
                "grant_type": "authorization_code",
                "code": back["code"],
                "redirect_uri": REDIRECT,
                "client_id": client_id,
                "code_verifier": verifier,
                "resource": resource,
            },
        )
    assert response.status_code == 200, response.text
    token: str = response.json()["access_token"]
    return token


class MemoryStorage:
    """The MCP client's token storage, with the provider's pre-registered test client."""

    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client = OAuthClientInformationFull(
            client_id="kbmesh-test",
            redirect_uris=[REDIRECT],
            token_endpoint_auth_method="none",
            grant_types=["authorization_code", "refresh_token"],
            response_types=["code"],
            scope=" ".join(SCOPES),
        )

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info


@contextlib.asynccontextmanager
async def signed_in_session(mcp_url: str, user: str) -> AsyncIterator[ClientSession]:
    """The official MCP client given only kbmesh's URL: it learns the provider from the 401,
    and signs `user` in by authorization code + PKCE."""
    returned: asyncio.Queue[dict[str, str]] = asyncio.Queue()

    async def redirect(url: str) -> None:
        await returned.put(await sign_in(url, user))

    async def callback() -> AuthorizationCodeResult:
        back = await returned.get()
        return AuthorizationCodeResult(
            code=back["code"], state=back.get("state"), iss=back.get("iss")
        )

    auth = OAuthClientProvider(
        server_url=mcp_url,
        client_metadata=OAuthClientMetadata(
            redirect_uris=[REDIRECT],
            token_endpoint_auth_method="none",
            grant_types=["authorization_code", "refresh_token"],
            response_types=["code"],
            scope=" ".join(SCOPES),
        ),
        storage=MemoryStorage(),
        redirect_handler=redirect,
        callback_handler=callback,
    )
    async with (
        httpx2.AsyncClient(auth=auth, timeout=httpx2.Timeout(120.0, read=300.0)) as http,
        streamable_http_client(mcp_url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    """A provider on loopback, kbmesh trusting it (org from the `org` claim, KBs from `kbs`),
    two KBs in org acme made by an API key, and bob limited to the first."""
    tmp = tmp_path_factory.mktemp("oauth")
    accounts = tmp / "accounts.json"
    accounts.write_text(
        json.dumps({"alice": {"org": "acme", "email": "alice@example.com", "name": "Alice"}})
    )
    port, kb_port = free_port(), free_port()
    issuer = f"http://127.0.0.1:{port}"
    resource = f"http://127.0.0.1:{kb_port}/mcp"
    oauth = {"issuer": issuer, "resource": resource, "org_claim": "org", "kb_claim": "kbs"}
    async with (
        oidc_provider(issuer, port, accounts),
        running_stack(tmp / "data", embedders=embedders, oauth=oauth) as (rt, _client),
        serve_http(rt, port=kb_port) as (base, _app),
    ):
        admin = await OperatorKeys(rt).create("acme", "admin")
        headers = {"Authorization": f"Bearer {admin}"}
        kbs = {}
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as http:
            for label in ("mine", "other"):
                response = await http.post(
                    "/v1/kbs", json={"name": f"{label}-{uuid.uuid4().hex[:6]}"}
                )
                assert response.status_code == 201, response.text
                kbs[label] = response.json()["kb_id"]
        accounts.write_text(
            json.dumps(
                {
                    "alice": {"org": "acme", "email": "alice@example.com", "name": "Alice"},
                    "bob": {"org": "acme", "kbs": [kbs["mine"]]},
                }
            )
        )
        yield SimpleNamespace(
            rt=rt,
            base=base,
            issuer=issuer,
            resource=resource,
            kbs=kbs,
            admin=admin,
            accounts=accounts,
            port=port,
        )


async def test_mcp_client_signs_in_by_url_only_and_the_user_is_the_writer(stack):
    """Given kbmesh's URL alone, the official MCP client discovers the provider from the 401,
    signs alice in (authorization code + PKCE, resource indicator), lists tools, uploads and
    searches; the audit trail names alice (subject, name, e-mail) as the upload's writer, and
    `?writer=alice` finds it."""
    async with signed_in_session(f"{stack.base}/mcp", "alice") as session:
        names = {t.name for t in (await session.list_tools()).tools}
        assert {"kb_search", "kb_upload"} <= names
        doc = ok(
            await session.call_tool(
                "kb_upload",
                {
                    "kb": stack.kbs["mine"],
                    "name": "volcanoes.md",
                    "content": DOCS["volcanoes.md"],
                    "wait": True,
                },
            )
        )
        found = ok(
            await session.call_tool("kb_search", {"kb": stack.kbs["mine"], "query": "volcano"})
        )
        assert found["hits"][0]["document_id"] == doc["document_id"], found
    async with httpx.AsyncClient(base_url=stack.base, timeout=60) as http:
        response = await http.get(
            "/v1/audit",
            params={"writer": "alice", "kind": "document"},
            headers={"Authorization": f"Bearer {stack.admin}"},
        )
    assert response.status_code == 200, response.text
    entries = [e for e in response.json()["items"] if e.get("document_id") == doc["document_id"]]
    assert entries, response.json()
    assert {k: v for k, v in entries[0]["writer"].items() if v is not None} == {
        "kind": "user",
        "subject": "alice",
        "name": "Alice",
        "email": "alice@example.com",
    }


async def test_unauthenticated_requests_point_at_the_provider(stack):
    """A request without credentials gets 401 with `WWW-Authenticate: Bearer
    resource_metadata=..., scope=...`; the metadata (path-suffixed for /mcp, and bare) names
    the issuer and the scopes."""
    async with httpx.AsyncClient(base_url=stack.base, timeout=60) as http:
        response = await http.get("/v1/kbs")
        assert response.status_code == 401
        challenge = response.headers["www-authenticate"]
        meta_url = f"{stack.base}/.well-known/oauth-protected-resource/mcp"
        assert f'resource_metadata="{meta_url}"' in challenge
        assert 'scope="kb:read kb:write kb:admin"' in challenge
        for path in (
            "/.well-known/oauth-protected-resource/mcp",
            "/.well-known/oauth-protected-resource",
        ):
            meta = (await http.get(path)).json()
            assert meta["resource"] == stack.resource
            assert meta["authorization_servers"] == [stack.issuer]
            assert meta["scopes_supported"] == list(SCOPES)


async def test_tokens_not_for_kbmesh_are_refused(stack, tmp_path):
    """Refused with 401: a token issued for another audience, one that expired, and one
    signed by a key the provider does not publish (an impostor claiming the same issuer);
    a fresh token for kbmesh is accepted, and so is the API key beside it."""
    async with httpx.AsyncClient(base_url=stack.base, timeout=60) as http:

        async def status(token: str) -> httpx.Response:
            return await http.get("/v1/kbs", headers={"Authorization": f"Bearer {token}"})

        good = await token_for(stack.issuer, "alice", stack.resource, "kb:read")
        assert (await status(good)).status_code == 200
        assert (await status(stack.admin)).status_code == 200

        other = await token_for(stack.issuer, "alice", "http://127.0.0.1:1/elsewhere", "kb:read")
        refused = await status(other)
        assert refused.status_code == 401
        assert "audience" in refused.json()["detail"]
        assert 'error="invalid_token"' in refused.headers["www-authenticate"]

        impostor_port = free_port()
        async with oidc_provider(stack.issuer, impostor_port, stack.accounts):
            forged = await token_for(
                f"http://127.0.0.1:{impostor_port}", "alice", stack.resource, "kb:read"
            )
        refused = await status(forged)
        assert refused.status_code == 401, refused.text

        short = await token_for(
            stack.issuer, "alice", stack.resource, "kb:read", client_id="kbmesh-short"
        )
        # The provider's TTL for this client is one second; kbmesh allows its clock leeway.
        async with asyncio.timeout(30):
            while (refused := await status(short)).status_code == 200:
                await asyncio.sleep(0.2)
        assert refused.status_code == 401
        assert "expired" in refused.json()["detail"]


async def test_scopes_and_kb_claims_confine_users(stack):
    """A token without kb:write uploading gets 403 naming kb:write (and the challenge says
    `insufficient_scope`); bob, limited to one KB by his `kbs` claim, cannot read the other
    through the tools."""
    reader = await token_for(stack.issuer, "alice", stack.resource, "kb:read")
    async with httpx.AsyncClient(base_url=stack.base, timeout=60) as http:
        response = await http.post(
            "/v1/documents",
            json={"kb_id": stack.kbs["mine"], "name": "x.md", "content": "# x\n\nx"},
            headers={"Authorization": f"Bearer {reader}"},
        )
    assert response.status_code == 403, response.text
    assert "kb:write" in response.json()["detail"]
    assert 'error="insufficient_scope"' in response.headers["www-authenticate"]
    assert 'scope="kb:write"' in response.headers["www-authenticate"]

    async with signed_in_session(f"{stack.base}/mcp", "bob") as session:
        failed(
            await session.call_tool("kb_search", {"kb": stack.kbs["other"], "query": "volcano"}),
            "NotFound",
        )
        ok(await session.call_tool("kb_search", {"kb": stack.kbs["mine"], "query": "volcano"}))
