"""kbmesh as an OAuth 2.1 resource server (the MCP authorization spec): JWT access tokens of
the configured identity provider become principals, beside API keys.

A token is trusted when PyJWT verifies it against the provider's published keys (PyJWKClient
caches them and fetches the set again for a key id it has not seen, so rotated keys are picked
up), names the configured issuer, is current (`exp`, `nbf`) and names kbmesh's resource URL as
its audience (RFC 8707): a token the provider issued for another service is refused here.
Its scopes are the rights keys have today; the org and the KBs it may reach come from claims.

- `TokenVerifier`: a token → the SDK's `AccessToken` (`InvalidToken`; `Transient` when the
  provider's keys cannot be had).
- `principal_fields`: an `AccessToken` → what the `Principal` every route and tool checks holds.
- `protected_resource_routes`: RFC 9728 metadata naming the issuer and the scopes.
- `sign_in`: what the console and `kbmesh login` need to sign a person in (`GET /v1/sign-in`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx
import jwt
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.routes import build_resource_metadata_url, create_protected_resource_routes
from pydantic import AnyHttpUrl, BaseModel, Field
from starlette.routing import Route

from services.common.domain.errors import KbmeshError, Transient
from services.common.domain.ids import check_id
from services.common.domain.models import Writer
from services.common.settings import OAuthSettings

READ_SCOPE, WRITE_SCOPE, ADMIN_SCOPE = "kb:read", "kb:write", "kb:admin"
SCOPES = (READ_SCOPE, WRITE_SCOPE, ADMIN_SCOPE)
# What a person's sign-in asks for beside kbmesh's scopes: an ID token naming them, and a
# refresh token so that `kbmesh login` lasts beyond one access token.
SIGN_IN_SCOPES = ("openid", "profile", "email", "offline_access")
# Scopes of the form kb:<kb id> limit a user to those KBs when KBMESH_OAUTH__KB_CLAIM=scope.
KB_SCOPE_PREFIX = "kb:"
# Only signatures by a public key: never `none`, and never HMAC, where the published key
# would itself sign tokens.
ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512"]
# Clock difference between kbmesh and the provider tolerated on `exp`, `nbf` and `iat`.
LEEWAY_SECONDS = 5
# How long the provider's key set is kept before it is asked again; an unknown key id asks
# sooner (PyJWKClient's refresh, at most once per its cooldown of 30 s).
JWKS_LIFESPAN_SECONDS = 300
FETCH_TIMEOUT_SECONDS = 10


class InvalidToken(KbmeshError):
    """A bearer token that is not a valid access token for kbmesh (401)."""

    status_code = 401
    error_type = "Unauthorized"


class TokenVerifier:
    """The SDK's `TokenVerifier` for one issuer's JWT access tokens. `verify` raises with the
    reason; `verify_token` (the SDK's protocol) answers None for an invalid token."""

    def __init__(self, settings: OAuthSettings) -> None:
        if not settings.issuer or not settings.resource:
            raise ValueError("TokenVerifier needs KBMESH_OAUTH__ISSUER and __RESOURCE")
        self.settings = settings
        self.issuer = settings.issuer
        self.resource = settings.resource
        self._jwks: jwt.PyJWKClient | None = None
        self._lock = asyncio.Lock()

    async def verify_token(self, token: str) -> AccessToken | None:
        try:
            return await self.verify(token)
        except InvalidToken:
            return None

    async def verify(self, token: str) -> AccessToken:
        """The verified token. `InvalidToken` (401) for anything a client sent wrong;
        `Transient` (503) when the provider's keys cannot be had and none cached fits."""
        jwks = await self.jwks()
        try:
            key = await asyncio.to_thread(jwks.get_signing_key_from_jwt, token)
        except jwt.PyJWKClientConnectionError as err:
            raise Transient(
                f"the identity provider's signing keys cannot be fetched ({err}); try again"
            ) from err
        except jwt.PyJWTError as err:  # not a JWT, or signed by a key the provider lacks
            raise InvalidToken(f"the access token is not valid: {err}") from err
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=ALGORITHMS,
                audience=self.resource,
                issuer=self.issuer,
                leeway=LEEWAY_SECONDS,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except jwt.ExpiredSignatureError as err:
            raise InvalidToken("the access token has expired; sign in again") from err
        except jwt.InvalidAudienceError as err:
            raise InvalidToken(
                f"the access token was not issued for {self.resource} (its audience differs)"
            ) from err
        except jwt.PyJWTError as err:
            raise InvalidToken(f"the access token is not valid: {err}") from err
        scope = claims.get("scope", "")
        scopes = scope.split() if isinstance(scope, str) else [str(s) for s in scope]
        return AccessToken(
            token=token,
            client_id=str(claims.get("client_id") or claims.get("azp") or ""),
            scopes=scopes,
            expires_at=int(claims["exp"]),
            resource=self.resource,
            subject=str(claims["sub"]),
            claims=claims,
        )

    async def jwks(self) -> jwt.PyJWKClient:
        """The key-set client, its URL discovered from the issuer on first use (and asked
        again on the next request when the provider could not be reached)."""
        async with self._lock:
            if self._jwks is None:
                url = self.settings.jwks_url or await self.discover_jwks_url()
                self._jwks = jwt.PyJWKClient(
                    url, lifespan=JWKS_LIFESPAN_SECONDS, timeout=FETCH_TIMEOUT_SECONDS
                )
            return self._jwks

    async def discover_jwks_url(self) -> str:
        base = self.issuer.rstrip("/")
        urls = [f"{base}/.well-known/openid-configuration"]
        parts = urlsplit(self.issuer)
        # RFC 8414: the well-known segment goes before an issuer's path.
        urls.append(
            f"{parts.scheme}://{parts.netloc}/.well-known/oauth-authorization-server"
            f"{parts.path.rstrip('/')}"
        )
        try:
            async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_SECONDS) as http:
                for url in urls:
                    response = await http.get(url)
                    if response.status_code == 200:
                        found = response.json().get("jwks_uri")
                        if isinstance(found, str):
                            return found
        except (httpx.HTTPError, ValueError) as err:
            raise Transient(
                f"the identity provider {self.issuer} cannot be reached ({err}); try again"
            ) from err
        raise Transient(
            f"the identity provider {self.issuer} publishes no jwks_uri; set KBMESH_OAUTH__JWKS_URL"
        )


def principal_fields(
    token: AccessToken, settings: OAuthSettings, default_org: str
) -> dict[str, Any]:
    """What a verified token grants, as `Principal` fields: its org, the KBs it may reach,
    whether it may write, its rights as scopes, and the user as writer. `InvalidToken` for a
    token that grants nothing here."""
    claims = token.claims or {}
    if READ_SCOPE not in token.scopes and not set(token.scopes) & {WRITE_SCOPE, ADMIN_SCOPE}:
        raise InsufficientScope(READ_SCOPE)
    org_id = default_org
    if settings.org_claim:
        value = claims.get(settings.org_claim)
        if not isinstance(value, str) or not value:
            raise InvalidToken(f"the access token has no {settings.org_claim!r} claim (the org)")
        try:
            org_id = check_id(value, settings.org_claim)
        except KbmeshError as err:
            raise InvalidToken(f"the access token's org is not valid: {err.message}") from err
    return {
        "org_id": org_id,
        "kb_ids": token_kbs(token, settings.kb_claim),
        "read_only": not set(token.scopes) & {WRITE_SCOPE, ADMIN_SCOPE},
        "scopes": frozenset(token.scopes),
        "writer": user_writer(token),
    }


def token_kbs(token: AccessToken, claim: str | None) -> tuple[str, ...] | None:
    """The KBs the token is limited to, or None (every KB of its org)."""
    if not claim:
        return None
    if claim == "scope":
        kbs = [
            s.removeprefix(KB_SCOPE_PREFIX)
            for s in token.scopes
            if s.startswith(KB_SCOPE_PREFIX) and s not in SCOPES
        ]
        return tuple(kbs) or None
    value = (token.claims or {}).get(claim)
    if value is None:
        return None
    items: Sequence[Any] = value.split() if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise InvalidToken(f"the access token's {claim!r} claim is not a list of KB ids")
    return tuple(str(i) for i in items)


def user_writer(token: AccessToken) -> Writer:
    claims = token.claims or {}
    name = claims.get("name") or claims.get("preferred_username")
    email = claims.get("email")
    return Writer(
        kind="user",
        subject=token.subject,
        name=str(name)[:200] if name else None,
        email=str(email)[:320] if email else None,
    )


class InsufficientScope(KbmeshError):
    """A valid token without the scope an operation needs (403, naming the scope)."""

    status_code = 403
    error_type = "Forbidden"

    def __init__(self, scope: str) -> None:
        super().__init__(f"this access token lacks the scope {scope!r}, which this needs")
        self.scope = scope


def metadata_url(settings: OAuthSettings) -> str:
    """Where kbmesh's protected resource metadata lies (RFC 9728 §3.1: its resource's path
    after the well-known segment)."""
    return str(build_resource_metadata_url(AnyHttpUrl(settings.resource or "")))


def challenge(
    settings: OAuthSettings, *, error: str | None = None, scope: str | None = None
) -> str:
    """The `WWW-Authenticate` value of a refusal: where to learn the issuer, and the scopes
    to ask for (RFC 6750 §3, RFC 9728 §5.1)."""
    parts = [f'resource_metadata="{metadata_url(settings)}"']
    parts.append(f'scope="{scope or " ".join(SCOPES)}"')
    if error is not None:
        parts.insert(0, f'error="{error}"')
    return "Bearer " + ", ".join(parts)


def protected_resource_routes(settings: OAuthSettings) -> list[Route]:
    """The SDK's RFC 9728 metadata routes: at the path the resource URL gives (for a resource
    ending in /mcp, /.well-known/oauth-protected-resource/mcp) and at the bare well-known path,
    which REST clients and older MCP clients ask."""
    # Strings, not AnyHttpUrl: the metadata model keeps them as written (an issuer without a
    # path gains no "/"), and clients compare the issuer with the provider's exactly.
    kwargs: dict[str, Any] = {
        "resource_url": settings.resource,
        "authorization_servers": [settings.issuer],
        "scopes_supported": list(SCOPES),
        "resource_name": "kbmesh",
    }
    routes = create_protected_resource_routes(**kwargs)
    bare = "/.well-known/oauth-protected-resource"
    if all(r.path != bare for r in routes):
        routes.append(Route(bare, endpoint=routes[0].endpoint, methods=["GET", "OPTIONS"]))
    return routes


class SignIn(BaseModel):
    """How people sign in to this kbmesh: null fields mean with an API key only."""

    issuer: str | None = Field(None, description="the identity provider (OpenID issuer URL)")
    client_id: str | None = Field(
        None, description="the public client the console and `kbmesh login` sign in as"
    )
    resource: str | None = Field(
        None, description="kbmesh's resource URL: the `resource` to ask tokens for (RFC 8707)"
    )
    scopes: list[str] = Field(
        default_factory=list, description="the scopes a person's sign-in asks for"
    )


def sign_in(settings: OAuthSettings | None) -> SignIn:
    """The provider and client to sign people in with, when both are configured."""
    if settings is None or not settings.issuer or not settings.client_id:
        return SignIn()
    return SignIn(
        issuer=settings.issuer,
        client_id=settings.client_id,
        resource=settings.resource,
        scopes=[*SIGN_IN_SCOPES, *SCOPES],
    )


def sign_in_origins(settings: OAuthSettings | None) -> list[str]:
    """Origins the console's page must be allowed to fetch from to sign in (its CSP's
    `connect-src`): the provider's, for its discovery document and token endpoint."""
    config = sign_in(settings)
    if config.issuer is None:
        return []
    parts = urlsplit(config.issuer)
    return [f"{parts.scheme}://{parts.netloc}"]
