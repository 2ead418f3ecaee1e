"""Credentials → principals: API keys (random tokens; only their SHA-256 is stored) and, when
an identity provider is configured, its access tokens (`oauth.py`)."""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

from services.common.bus.audit import AuditEntry, AuditSink
from services.common.bus.registry import ApiKey, Registry
from services.common.domain.errors import Conflict, Forbidden, KbmeshError, NotFound
from services.common.domain.ids import check_id, new_id
from services.common.domain.models import LOCAL_WRITER, Writer
from services.common.settings import OAuthSettings
from services.gateway.oauth import (
    ADMIN_SCOPE,
    WRITE_SCOPE,
    InsufficientScope,
    InvalidToken,
    TokenVerifier,
    challenge,
    principal_fields,
)

KEY_PREFIX = "kbm_"


class Unauthorized(KbmeshError):
    status_code = 401
    error_type = "Unauthorized"

    def __init__(self, message: str, *, challenge: str | None = None) -> None:
        super().__init__(message)
        # The WWW-Authenticate value: where to sign in, when an identity provider is set.
        self.challenge = challenge or 'Bearer realm="kbmesh"'


@dataclass(frozen=True)
class Principal:
    org_id: str
    kb_ids: tuple[str, ...] | None = None  # None: every KB of the org
    read_only: bool = False
    # Who the caller is, recorded on what it writes: keyless loopback unless a key or a user.
    writer: Writer = LOCAL_WRITER
    # A signed-in user's rights as scopes (kb:read, kb:write, kb:admin); None for an API key,
    # whose rights are its shape (read-only, limited to some KBs).
    scopes: frozenset[str] | None = None

    def can_see(self, kb_id: str) -> bool:
        return self.kb_ids is None or kb_id in self.kb_ids

    def check_kb(self, kb_id: str, *, write: bool = False) -> None:
        if not self.can_see(kb_id):
            raise NotFound(f"knowledge base {kb_id!r} not found", field="kb_id")
        if write:
            self.check_write()

    def check_write(self) -> None:
        if self.read_only:
            if self.scopes is not None:
                raise InsufficientScope(WRITE_SCOPE)
            raise Forbidden("this API key is read-only")

    def check_org_wide_write(self) -> None:
        """Operations not confined to one KB need an unscoped, writable key."""
        self.check_write()
        if self.kb_ids is not None:
            raise Forbidden("this API key is limited to some knowledge bases")

    def check_admin(self) -> None:
        """The org's administrators: an unscoped, writable key (or keyless loopback), or a
        user granted kb:admin."""
        if self.scopes is not None and ADMIN_SCOPE not in self.scopes:
            raise InsufficientScope(ADMIN_SCOPE)
        if self.read_only or self.kb_ids is not None:
            raise Forbidden("only an org-wide, writable API key (an org admin) may do this")

    @property
    def scope(self) -> list[str] | None:
        return list(self.kb_ids) if self.kb_ids is not None else None


def hash_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_id(key_hash: str) -> str:
    """A key's public id: the start of its hash (never the key itself)."""
    return key_hash[:12]


def key_writer(record: ApiKey) -> Writer:
    return Writer(kind="key", key_id=key_id(record.key_hash), name=record.name or None)


class KeyResolver:
    """Resolves bearer tokens: API keys, and the identity provider's access tokens when
    `oauth` names one. With no keys at all and no provider, everyone (on loopback) is the
    default org."""

    def __init__(
        self,
        keys: Registry[ApiKey],
        default_org: str,
        audit: AuditSink | None = None,
        oauth: OAuthSettings | None = None,
    ) -> None:
        self.keys = keys
        self.default_org = default_org
        self.audit = audit
        self.oauth = oauth if oauth is not None and oauth.issuer else None
        self.tokens = TokenVerifier(self.oauth) if self.oauth is not None else None
        self._any_keys: tuple[float, bool] = (0.0, False)

    def unauthorized(self, message: str, *, error: str | None = None) -> Unauthorized:
        """A 401 whose challenge points OAuth clients at the metadata naming the provider."""
        found = challenge(self.oauth, error=error) if self.oauth is not None else None
        return Unauthorized(message, challenge=found)

    def challenge_for(self, err: KbmeshError) -> str | None:
        """The `WWW-Authenticate` value of a refusal for `err`, if it has one: a 401's, or a
        missing scope's (RFC 6750 `insufficient_scope`, naming the scope)."""
        if isinstance(err, Unauthorized):
            return err.challenge
        if isinstance(err, InsufficientScope) and self.oauth is not None:
            return challenge(self.oauth, error="insufficient_scope", scope=err.scope)
        return None

    async def any_keys(self) -> bool:
        # A key created elsewhere (`kbmesh keys create`, another gateway replica) must end
        # keyless access at once. "Keys exist" is kept for a few seconds; "none" is asked of
        # the bucket again, or of its live mirror when there is one: a key stored anywhere
        # reaches the mirror within milliseconds, and the bucket is asked at least every
        # second anyway, so a mirror whose watch broke is never trusted for longer.
        checked, value = self._any_keys
        age = time.monotonic() - checked
        if value and age < 5.0:
            return True
        if self.keys.mirrored:
            if await self.keys.list():
                self._any_keys = (time.monotonic(), True)
                return True
            if age < 1.0:
                return False
        # The bucket's message count is one cheap request, 0 until a key is stored; listing
        # the keys on every keyless request would slow each search
        # (docs/benchmarks.md, "Figures behind the code").
        status = await self.keys.kv.status()
        value = status.values > 0 and bool(await self.keys.list(fresh=True))
        self._any_keys = (time.monotonic(), value)
        return value

    async def resolve(self, authorization: str | None, client_host: str | None) -> Principal:
        token = None
        if authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise self.unauthorized("use 'Authorization: Bearer <api key or access token>'")
        if token is None:
            # With an identity provider, every caller signs in: keyless access would also
            # hide from MCP clients the 401 that starts their sign-in.
            if self.oauth is not None:
                raise self.unauthorized("sign in with the identity provider, or use an API key")
            if await self.any_keys():
                raise Unauthorized("an API key is required ('Authorization: Bearer <key>')")
            if client_host not in (None, "127.0.0.1", "::1", "localhost", "testclient"):
                raise Unauthorized("without API keys, kbmesh serves loopback clients only")
            return Principal(org_id=self.default_org)
        token = token.strip()
        if self.tokens is not None and self.oauth is not None and not token.startswith(KEY_PREFIX):
            try:
                access = await self.tokens.verify(token)
                fields = principal_fields(access, self.oauth, self.default_org)
            except InvalidToken as err:
                raise self.unauthorized(err.message, error="invalid_token") from err
            return Principal(**fields)
        record = await self.keys.get(hash_key(token))
        if record is None:
            raise self.unauthorized("unknown API key")
        return Principal(
            org_id=record.org_id,
            kb_ids=tuple(record.kb_ids) if record.kb_ids is not None else None,
            read_only=record.read_only,
            writer=key_writer(record),
        )

    async def create(
        self,
        org_id: str,
        name: str = "",
        kb_ids: list[str] | None = None,
        read_only: bool = False,
        writer: Writer | None = None,
    ) -> str:
        """A new key, printed once; its creation goes on the audit trail with `writer` (by
        default the operator's command)."""
        # The org becomes the first segment of every registry key: no dots, no wildcards.
        check_id(org_id, "org_id")
        token = new_key()
        record = ApiKey(
            key_hash=hash_key(token),
            org_id=org_id,
            name=name,
            kb_ids=kb_ids,
            read_only=read_only,
        )
        await self.keys.put(record.key_hash, record)
        self._any_keys = (0.0, False)
        if self.audit is not None:
            await self.audit(
                AuditEntry(
                    event_id=new_id(),
                    org_id=org_id,
                    kind="key",
                    action="created",
                    writer=writer or Writer(kind="operator", name="kbmesh keys"),
                    key_id=key_id(record.key_hash),
                    name=name or None,
                )
            )
        return token

    async def list(self, org_id: str | None = None) -> list[ApiKey]:
        """The stored keys (their hashes, never the keys), of one org or of all."""
        found = await self.keys.list(fresh=True)
        return [k for k in found if org_id is None or k.org_id == org_id]

    async def revoke(self, ref: str, writer: Writer | None = None) -> ApiKey:
        """Delete the key whose id (or name, when only one key has it) is `ref`: requests
        with it are refused from then on. NotFound / Conflict when `ref` names none or
        several; the revocation goes on the audit trail."""
        keys = await self.keys.list(fresh=True)
        matches = [k for k in keys if key_id(k.key_hash) == ref] or [
            k for k in keys if k.name and k.name == ref
        ]
        if not matches:
            raise NotFound(f"no API key with id or name {ref!r}", field="key")
        if len(matches) > 1:
            ids = ", ".join(key_id(k.key_hash) for k in matches)
            raise Conflict(f"{len(matches)} keys are named {ref!r} ({ids}): give the id")
        (record,) = matches
        await self.keys.delete(record.key_hash)
        self._any_keys = (0.0, False)
        if self.audit is not None:
            await self.audit(
                AuditEntry(
                    event_id=new_id(),
                    org_id=record.org_id,
                    kind="key",
                    action="deleted",
                    writer=writer or Writer(kind="operator", name="kbmesh keys"),
                    key_id=key_id(record.key_hash),
                    name=record.name or None,
                )
            )
        return record
