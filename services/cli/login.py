"""`kbmesh login` and `kbmesh logout`: a person signs the CLI in with the identity provider
the server names (`GET /v1/sign-in`), by the device authorization grant (RFC 8628), and
`credential` is what every REST command sends.

The token (and its refresh token) is kept owner-only in `$XDG_CONFIG_HOME/kbmesh/token.json`
(`~/.config/kbmesh/token.json`), for the one API it was issued for: a command aimed at
another API never sends it. `KBMESH_API_KEY`, when set, wins over it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import jwt
from pydantic import BaseModel, ValidationError

from services.common.ops.files import write_private
from services.common.settings import ClientSettings

EXIT_ERROR = 1
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
TIMEOUT_SECONDS = 30
# RFC 8628 §3.2: poll every 5 seconds when the provider names no interval; §3.5: 5 more
# after each `slow_down`.
DEFAULT_INTERVAL_SECONDS = 5
SLOW_DOWN_SECONDS = 5
# Renewed this long before it expires, so a token does not lapse on its way to the server.
EXPIRY_MARGIN_SECONDS = 30


class SignInFailed(Exception):
    """Signing in could not be done or finished; the message says why and what to do."""


class StoredToken(BaseModel):
    """The sign-in kept for one API: where it came from, to renew it, and who it is."""

    api: str
    issuer: str
    client_id: str
    resource: str | None
    token_endpoint: str
    access_token: str
    refresh_token: str | None = None
    expires_at: float | None = None
    user: str | None = None


def token_path() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "kbmesh" / "token.json"


def add_parsers(sub: Any, default_api: str) -> None:
    login = sub.add_parser(
        "login",
        help="sign in with your identity provider (a code to enter in a browser); REST "
        "commands then use your token when KBMESH_API_KEY is unset",
    )
    login.add_argument("--api", default=default_api, help="the kbmesh REST API (KBMESH_API_URL)")
    login.add_argument(
        "--client-id",
        help="the provider's client to sign in as (default: the one the server names)",
    )
    sub.add_parser("logout", help="forget the token `kbmesh login` stored")


def run(args: argparse.Namespace) -> int:
    if args.command == "logout":
        path = token_path()
        if path.exists():
            path.unlink()
            print(f"signed out (removed {path})")
        else:
            print("not signed in")
        return 0
    try:
        stored = login(args.api.rstrip("/"), args.client_id)
    except SignInFailed as err:
        print(f"kbmesh login: {err}", file=sys.stderr)
        return EXIT_ERROR
    except httpx.HTTPError as err:
        print(f"kbmesh login: {err.request.url} cannot be reached ({err})", file=sys.stderr)
        return EXIT_ERROR
    print(f"signed in to {stored.api} as {stored.user or 'you'}; token kept in {token_path()}")
    return 0


def login(api: str, client_id: str | None = None) -> StoredToken:
    """Sign a person in by the device grant: print where to go and the code, poll until they
    have approved, keep the token."""
    with httpx.Client(timeout=TIMEOUT_SECONDS) as http:
        config = _json(http.get(f"{api}/v1/sign-in"), f"kbmesh at {api}")
        issuer = config.get("issuer")
        client_id = client_id or config.get("client_id")
        if not issuer or not client_id:
            raise SignInFailed(
                f"kbmesh at {api} names no identity provider to sign in with; use an API key "
                "(KBMESH_API_KEY)"
            )
        provider = _json(
            http.get(f"{issuer.rstrip('/')}/.well-known/openid-configuration"),
            f"the identity provider {issuer}",
        )
        device_endpoint = provider.get("device_authorization_endpoint")
        if not device_endpoint:
            raise SignInFailed(
                f"the identity provider {issuer} does not offer sign-in by code (the device "
                "authorization grant); use an API key (KBMESH_API_KEY)"
            )
        resource = config.get("resource")
        ask = {"client_id": client_id, "scope": " ".join(config.get("scopes") or [])}
        if resource:
            ask["resource"] = resource
        device = _json(http.post(device_endpoint, data=ask), "the identity provider")
        print(
            f"To sign in, open {device['verification_uri']} and enter the code "
            f"{device['user_code']}",
            flush=True,
        )
        if device.get("verification_uri_complete"):
            print(f"(or open {device['verification_uri_complete']})", flush=True)
        answer = _poll(http, provider["token_endpoint"], client_id, resource, device)
    stored = StoredToken(
        api=api,
        issuer=issuer,
        client_id=client_id,
        resource=resource,
        token_endpoint=provider["token_endpoint"],
        access_token=answer["access_token"],
        refresh_token=answer.get("refresh_token"),
        expires_at=_expires_at(answer),
        user=_who(answer.get("id_token")),
    )
    write_private(token_path(), stored.model_dump_json(indent=2))
    return stored


def _poll(
    http: httpx.Client,
    token_endpoint: str,
    client_id: str,
    resource: str | None,
    device: dict[str, Any],
) -> dict[str, Any]:
    """The token endpoint's answer once the person has approved (RFC 8628 §3.4-3.5)."""
    interval = float(device.get("interval") or DEFAULT_INTERVAL_SECONDS)
    deadline = time.monotonic() + float(device.get("expires_in") or 600)
    form = {"grant_type": DEVICE_GRANT, "device_code": device["device_code"]}
    form["client_id"] = client_id
    if resource:
        form["resource"] = resource
    while time.monotonic() < deadline:
        # The wait comes first: the person cannot have approved yet when the code is shown.
        time.sleep(interval)
        response = http.post(token_endpoint, data=form)
        if response.status_code == 200:
            answer: dict[str, Any] = response.json()
            return answer
        error = _error(response)
        if error == "authorization_pending":
            continue
        if error == "slow_down":
            interval += SLOW_DOWN_SECONDS
            continue
        if error == "access_denied":
            raise SignInFailed("the sign-in was declined")
        if error == "expired_token":
            break
        raise SignInFailed(f"the identity provider refused: {_reason(response)}")
    raise SignInFailed("the code expired before it was entered; run `kbmesh login` again")


def credential(api: str) -> str | None:
    """What a REST command sends as bearer to `api`: KBMESH_API_KEY, else the token `kbmesh
    login` stored for that API (renewed first when it has expired and can be)."""
    key = ClientSettings().api_key
    if key:
        return key
    stored = _load()
    if stored is None or stored.api != api.rstrip("/"):
        return None
    if stored.expires_at is None or stored.expires_at - EXPIRY_MARGIN_SECONDS > time.time():
        return stored.access_token
    if stored.refresh_token is None:
        return stored.access_token  # the server says it expired; `kbmesh login` renews
    try:
        return _refresh(stored).access_token
    except SignInFailed as err:
        print(
            f"kbmesh: your sign-in could not be renewed ({err}); run `kbmesh login`",
            file=sys.stderr,
        )
        return stored.access_token


def _refresh(stored: StoredToken) -> StoredToken:
    form = {
        "grant_type": "refresh_token",
        "refresh_token": stored.refresh_token or "",
        "client_id": stored.client_id,
    }
    if stored.resource:
        form["resource"] = stored.resource
    try:
        with httpx.Client(timeout=TIMEOUT_SECONDS) as http:
            answer = _json(http.post(stored.token_endpoint, data=form), "the identity provider")
    except httpx.HTTPError as err:
        raise SignInFailed(f"the identity provider cannot be reached ({err})") from err
    renewed = stored.model_copy(
        update={
            "access_token": answer["access_token"],
            # A provider that rotates refresh tokens sends a new one; one that does not, none.
            "refresh_token": answer.get("refresh_token") or stored.refresh_token,
            "expires_at": _expires_at(answer),
        }
    )
    write_private(token_path(), renewed.model_dump_json(indent=2))
    return renewed


def _load() -> StoredToken | None:
    path = token_path()
    try:
        return StoredToken.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as err:
        print(
            f"kbmesh: ignoring {path} ({err.__class__.__name__}); run `kbmesh login`",
            file=sys.stderr,
        )
        return None


def _json(response: httpx.Response, who: str) -> dict[str, Any]:
    if response.status_code != 200:
        raise SignInFailed(f"{who} answered HTTP {response.status_code}: {_reason(response)}")
    try:
        body = response.json()
    except ValueError as err:
        raise SignInFailed(f"{who} answered something other than JSON") from err
    if not isinstance(body, dict):
        raise SignInFailed(f"{who} answered something other than a JSON object")
    return body


def _error(response: httpx.Response) -> str | None:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error if isinstance(error, str) else None


def _reason(response: httpx.Response) -> str:
    try:
        body = response.json()
        return str(body.get("error_description") or body.get("error") or body.get("detail"))
    except (ValueError, AttributeError):
        return response.text[:200]


def _expires_at(answer: dict[str, Any]) -> float | None:
    expires_in = answer.get("expires_in")
    return time.time() + float(expires_in) if isinstance(expires_in, int | float) else None


def _who(id_token: str | None) -> str | None:
    """The person the ID token names, for saying who signed in. Its signature is not checked:
    it came straight from the provider's token endpoint, and decides nothing."""
    if not id_token:
        return None
    try:
        claims = jwt.decode(id_token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return None
    name, email = claims.get("name"), claims.get("email")
    if name and email:
        return f"{name} <{email}>"
    return str(name or email or claims.get("sub") or "") or None
