"""Sources as clients manage them: definitions in the org's scope, the secrets that go with
them (write-only), "sync now", and the webhook that git hosts call on a push.

The gateway never runs a sync: it publishes `source.sync` and the sources service runs it.
A source feeds one KB, so the KB's access rules are the source's: a key limited to some KBs
manages only the sources feeding them (any other is not found), a read-only key may list and
read them. Secrets (a git token or key, the webhook's secret) live in `source-secrets`; no
answer carries them, except the webhook secret in the one answer that creates it.

A webhook call carries no API key: it proves itself with the source's secret, as git hosts
sign push events (GitHub, Gitea, Forgejo: `X-Hub-Signature-256: sha256=<HMAC-SHA256 of the
body>`; GitLab: the secret itself in `X-Gitlab-Token`), compared in constant time. An unknown
source, a missing signature and a wrong one get the same answer, so the hook tells a stranger
nothing about which sources exist; refused calls on a real source go on its org's audit
trail."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
from pydantic import ValidationError

from services.common.bus.audit import AuditAction, AuditEntry
from services.common.bus.audit import sink as audit_sink
from services.common.bus.client import Bus
from services.common.bus.registry import Registries, SourceRegistry, SourceSecretsRegistry
from services.common.domain.errors import Conflict, InvalidInput, NotFound
from services.common.domain.ids import is_id, new_id
from services.common.domain.models import Writer
from services.common.domain.sources import Source, SourcePlacement, SourceSecrets, SourceSpec
from services.common.messages.events import DocDeleted, SourceSync
from services.common.messages.names import Subject
from services.common.outbound.egress import EgressPolicy, egress_policy, parse_http_url
from services.common.settings import Settings
from services.gateway.auth import Principal, Unauthorized
from services.gateway.schemas import (
    SourceAck,
    SourceCreate,
    SourceList,
    SourceStatus,
    SourceUpdate,
    SourceView,
)
from services.gateway.service.access import check_tag_scope
from services.gateway.service.kbs import KnowledgeBases

log = logging.getLogger("kbmesh.gateway.sources")

# Remote git URLs a client may give; a local path only the operator on the gateway's machine.
GIT_SCHEMES = {"https": 443, "http": 80, "ssh": 22, "git": 9418}
# `user@host:path`, git's scp-like ssh syntax.
SCP_LIKE = "@"
SIGNATURE_HEADER = "x-hub-signature-256"
GITEA_SIGNATURE_HEADER = "x-gitea-signature"
TOKEN_HEADER = "x-gitlab-token"
HOOK_REFUSED = (
    "this call is not signed with the source's webhook secret: send X-Hub-Signature-256 "
    "(sha256=<HMAC-SHA256 of the body>) or X-Gitlab-Token"
)
# Refused webhook calls of one source are audited once per this window, with a count of the
# others: a stranger who knows a source's id cannot flood the audit trail.
REFUSED_AUDIT_WINDOW_SECONDS = 60.0
# Compared against when the source does not exist, so an unknown id costs what a known one
# does (no timing oracle either).
_DECOY_SECRET = secrets.token_urlsafe(32)
# The events that announce a hook rather than a push (GitHub, Gitea/Forgejo, GitLab has none).
PING_EVENTS = {("x-github-event", "ping"), ("x-gitea-event", "ping"), ("x-gogs-event", "ping")}


class HookRefused(Unauthorized):
    """A webhook call that does not prove the source's secret (or names no source)."""

    def __init__(self) -> None:
        super().__init__(HOOK_REFUSED, challenge='HMAC realm="kbmesh-webhook"')


class Sources:
    def __init__(
        self, bus: Bus, registries: Registries, kbs: KnowledgeBases, settings: Settings
    ) -> None:
        self.bus = bus
        self.reg = registries
        self.kbs = kbs
        self.settings = settings
        self._audit_sink = audit_sink(lambda: bus.js)
        # source key → (start of its window, refused calls in it not yet audited)
        self._refused: dict[str, tuple[float, int]] = {}

    @property
    def sources(self) -> SourceRegistry:
        return self.reg.sources

    @property
    def secrets(self) -> SourceSecretsRegistry:
        return self.reg.source_secrets

    # ---- definitions --------------------------------------------------------------------

    async def create(self, p: Principal, body: SourceCreate) -> SourceView:
        spec = checked_spec(body.model_dump(exclude={"source_id", "token", "ssh_key"}))
        kb = await self.kbs.resolve(p, spec.kb, write=True)
        await self._check_tags(p, spec)
        await self._check_location(p, spec)
        check_credentials(spec, body.token, body.ssh_key)
        source = Source(
            **spec.model_dump(),
            org_id=p.org_id,
            source_id=body.source_id or new_id(),
            kb_id=kb.kb_id,
            has_credentials=bool(body.token or body.ssh_key),
        )
        try:
            await self.sources.definitions.create(source.key, source)
        except Conflict as err:
            raise Conflict(
                f"a source with id {source.source_id!r} exists", field="source_id"
            ) from err
        hook_secret = new_hook_secret()
        await self.secrets.put(
            source.key,
            SourceSecrets(token=body.token, ssh_key=body.ssh_key, webhook_secret=hook_secret),
        )
        await self._audit(p.org_id, p.writer, source, "created")
        return await self._view(source, webhook_secret=hook_secret)

    async def page(self, p: Principal, kb: str | None = None) -> SourceList:
        found = [s for s in await self.sources.of_org(p.org_id) if p.can_see(s.kb_id)]
        if kb is not None:
            kb_id = (await self.kbs.resolve(p, kb)).kb_id
            found = [s for s in found if s.kb_id == kb_id]
        found.sort(key=lambda s: (s.created_at, s.source_id))
        views = await asyncio.gather(*(self._view(s) for s in found))
        return SourceList(items=list(views), total=len(views))

    async def get(self, p: Principal, ref: str) -> SourceView:
        return await self._view(await self.resolve(p, ref))

    async def resolve(self, p: Principal, ref: str, *, write: bool = False) -> Source:
        """A source of the caller's org and scope by id, else by name when one has it (404
        otherwise: a scoped key is never told of a source outside its scope)."""
        source = (
            await self.sources.definitions.get(self.sources.key(p.org_id, ref))
            if is_id(ref)
            else None
        )
        if source is None:
            named = [s for s in await self.sources.of_org(p.org_id) if s.name == ref]
            named = [s for s in named if p.can_see(s.kb_id)]
            if len(named) > 1:
                ids = ", ".join(s.source_id for s in named)
                raise Conflict(f"{len(named)} sources are named {ref!r} ({ids}): give the id")
            source = named[0] if named else None
        if source is None or not p.can_see(source.kb_id):
            raise NotFound(f"source {ref!r} not found", field="source_id")
        if write:
            p.check_write()
        return source

    async def update(self, p: Principal, ref: str, body: SourceUpdate) -> SourceView:
        source = await self.resolve(p, ref, write=True)
        given = body.model_dump(exclude_unset=True)
        for required in ("kb", "url"):
            if required in given and given[required] is None:
                raise InvalidInput(f"{required} cannot be null", field=required)
        secret_fields = {"token", "ssh_key", "clear_credentials", "rotate_webhook_secret"}
        changes = {k: v for k, v in given.items() if k not in secret_fields}
        current = SourceSpec.model_validate(source.model_dump(include=set(SourceSpec.model_fields)))
        merged = {**current.model_dump(), **changes}
        # null: back to the field's default
        spec = checked_spec({k: v for k, v in merged.items() if v is not None})
        kb_id = source.kb_id
        if spec.kb != current.kb:
            kb_id = (await self.kbs.resolve(p, spec.kb, write=True)).kb_id
        else:
            p.check_kb(kb_id, write=True)
        await self._check_tags(p, spec)
        if any(getattr(spec, f) != getattr(current, f) for f in _LOCATION_FIELDS):
            await self._check_location(p, spec)
        hook_secret = new_hook_secret() if body.rotate_webhook_secret else None
        kept, secrets_after = await self._secrets_after(source, body, spec, hook_secret)
        credentials = bool(secrets_after.token or secrets_after.ssh_key)

        def apply(stored: Source) -> Source:
            return Source(
                **spec.model_dump(),
                org_id=stored.org_id,
                source_id=stored.source_id,
                kb_id=kb_id,
                has_credentials=credentials,
                created_at=stored.created_at,
            )

        changed = await self.sources.definitions.change(source.key, apply)
        if changed is None:
            raise NotFound(f"source {ref!r} not found", field="source_id")
        # After the definition: a source removed meanwhile leaves no secrets behind.
        if secrets_after != kept:
            await self.secrets.put(source.key, secrets_after)
        await self._audit(p.org_id, p.writer, changed[1], "changed")
        if SourcePlacement.of(changed[1]) != SourcePlacement.of(source):
            # Its documents are re-placed by a run (the sources service sends them all
            # again): at once rather than at the next scheduled one.
            await self.bus.publish(
                Subject.SOURCE_SYNC,
                SourceSync(
                    org_id=source.org_id,
                    source_id=source.source_id,
                    trigger="manual",
                    writer=p.writer,
                ),
            )
        return await self._view(changed[1], webhook_secret=hook_secret)

    async def _secrets_after(
        self, source: Source, body: SourceUpdate, spec: SourceSpec, hook_secret: str | None
    ) -> tuple[SourceSecrets | None, SourceSecrets]:
        """The secrets stored now (None: none) and as the update leaves them, checked
        against the updated definition (a token for https, a key for ssh)."""
        kept = await self.secrets.get(source.key)
        updated = (kept or SourceSecrets(webhook_secret=new_hook_secret())).model_copy()
        if body.clear_credentials:
            updated.token = updated.ssh_key = None
        if body.token is not None:
            updated.token = body.token
        if body.ssh_key is not None:
            updated.ssh_key = body.ssh_key
        if hook_secret is not None:
            updated.webhook_secret = hook_secret
        check_credentials(spec, updated.token, updated.ssh_key)
        return kept, updated

    async def delete(self, p: Principal, ref: str, *, keep_documents: bool = False) -> SourceAck:
        """Remove the source: its definition, state, lease and secrets, and (unless
        `keep_documents`) its documents, which ingest deletes from every KB."""
        source = await self.resolve(p, ref, write=True)
        p.check_kb(source.kb_id, write=True)
        # The definition first: the sources service runs nothing that has none.
        await self.sources.definitions.delete(source.key)
        await asyncio.gather(
            self.sources.states.delete(self.sources.state_key(source.org_id, source.source_id)),
            self.sources.leases.delete(self.sources.lease_key(source.org_id, source.source_id)),
            self.secrets.delete(source.key),
        )
        if not keep_documents:
            event = await self._documents_deleted(p, source)
            if event is not None:
                await self.bus.publish(Subject.DOC_DELETED, event)
        await self._audit(p.org_id, p.writer, source, "deleted")
        return SourceAck(
            status="deleted", source_id=source.source_id, documents_deleted=not keep_documents
        )

    async def _documents_deleted(self, p: Principal, source: Source) -> DocDeleted | None:
        """The deletion of the source's documents the caller may make: every one of the
        source (those still on their way too) for an org-wide key; for a key limited to
        some KBs, only those wholly inside its scope (a document of the same source id in
        another KB is not its to delete)."""
        if p.kb_ids is None:
            return DocDeleted(org_id=p.org_id, source_id=source.source_id, writer=p.writer)
        catalog = self.kbs.catalog
        await catalog.settled()
        ids = [
            r.document_id
            for r in catalog.documents(p.org_id)
            if r.source_id == source.source_id and r.writable_in(p.kb_ids)
        ]
        if not ids:
            return None
        return DocDeleted(org_id=p.org_id, document_ids=ids, writer=p.writer)

    # ---- runs -----------------------------------------------------------------------------

    async def sync(self, p: Principal, ref: str) -> SourceAck:
        """Ask the sources service to run the source now (it runs again right after a run
        already under way)."""
        source = await self.resolve(p, ref, write=True)
        await self.bus.publish(
            Subject.SOURCE_SYNC,
            SourceSync(
                org_id=source.org_id, source_id=source.source_id, trigger="manual", writer=p.writer
            ),
        )
        return SourceAck(status="requested", source_id=source.source_id, trigger="manual")

    async def hook(
        self, source_id: str, body: bytes, headers: Mapping[str, str], caller: str | None
    ) -> SourceAck:
        """A git host's push event: verified with the source's webhook secret, then a sync
        (`trigger="hook"`). HookRefused, the same for every failure, when it does not verify."""
        # A source feeds a KB of its org: the orgs with KBs (a live mirror) are the places
        # to look.
        orgs = {kb.org_id for kb in await self.kbs.reg.kbs.list()}
        candidates = await self.sources.with_id(source_id, orgs)
        found = await asyncio.gather(*(self.secrets.get(s.key) for s in candidates))
        signed = _Signed(body, headers)
        match = None
        for source, kept in zip(candidates, found, strict=True):
            if kept is not None and signed.verifies(kept.webhook_secret):
                match = source
        if not candidates:
            signed.verifies(_DECOY_SECRET)
        if match is None:
            reason = signed.refusal()
            for source in candidates:
                await self._refused_call(source, caller, reason)
            log.warning(
                "webhook call refused source_id=%s caller=%s reason=%s known=%s",
                source_id[:64],
                caller,
                reason,
                bool(candidates),
            )
            raise HookRefused()
        if not match.enabled:
            raise Conflict(f"source {match.source_id!r} is disabled: enable it to sync on push")
        if signed.is_ping():
            return SourceAck(status="pong", source_id=match.source_id)
        if not pushes_branch(match, signed.payload()):
            return SourceAck(status="ignored", source_id=match.source_id, trigger="hook")
        await self.bus.publish(
            Subject.SOURCE_SYNC,
            SourceSync(
                org_id=match.org_id,
                source_id=match.source_id,
                trigger="hook",
                writer=hook_writer(caller),
            ),
        )
        return SourceAck(status="requested", source_id=match.source_id, trigger="hook")

    async def _refused_call(self, source: Source, caller: str | None, reason: str) -> None:
        """Audit a refused call, at most once per source per window, counting the others."""
        now = time.monotonic()
        start, pending = self._refused.get(source.key, (0.0, 0))
        if now - start < REFUSED_AUDIT_WINDOW_SECONDS:
            self._refused[source.key] = (start, pending + 1)
            return
        self._refused[source.key] = (now, 0)
        if pending:
            reason += f" ({pending} more refused calls in the minute before)"
        await self._audit(source.org_id, hook_writer(caller), source, "refused", error=reason)

    # ---- views and checks ----------------------------------------------------------------

    async def _view(self, source: Source, *, webhook_secret: str | None = None) -> SourceView:
        state = await self.sources.state(source.org_id, source.source_id)
        status = (
            SourceStatus(
                last_run=state.last_run,
                next_run_at=state.next_run_at,
                requested=state.requested,
                runs=state.runs,
            )
            if state is not None
            else SourceStatus()
        )
        return SourceView(
            **source.model_dump(exclude={"org_id"}),
            hook_path=f"/v1/sources/{source.source_id}/hook",
            webhook_secret=webhook_secret,
            status=status,
        )

    async def _check_tags(self, p: Principal, spec: SourceSpec) -> None:
        """A source's tags go on its documents, and tags are membership: a key limited to
        some KBs cannot make a source whose documents join a KB outside its scope."""
        if p.kb_ids is not None and spec.tags:
            check_tag_scope(p, await self.kbs.reg.kbs.of_org(p.org_id), spec.tags)

    async def _check_location(self, p: Principal, spec: SourceSpec) -> None:
        """The source's URLs are ones this server may read: remote git URLs of the known
        schemes (a local path only for the operator on this machine), web URLs over http(s);
        every host through the egress rule, as any URL a client makes the server fetch."""
        policy = egress_policy(self.settings)
        if spec.kind == "git":
            await check_git_url(spec.url, policy, local_allowed=p.writer.kind == "local")
            return
        for field, url in (
            ("url", spec.url),
            ("sitemap", spec.sitemap),
            *(("start_urls", u) for u in spec.start_urls),
        ):
            if url is not None:
                await policy.check_url(url, field=field, what="crawl")
        if spec.scope is not None:
            parse_http_url(spec.scope, "scope")

    async def _audit(
        self,
        org_id: str,
        writer: Writer,
        source: Source,
        action: AuditAction,
        *,
        error: str | None = None,
    ) -> None:
        await self._audit_sink(
            AuditEntry(
                org_id=org_id,
                kind="source",
                action=action,
                writer=writer,
                kb_id=source.kb_id,
                source_id=source.source_id,
                name=source.name or source.url,
                error=error,
            )
        )


# Fields whose change means reading from somewhere else: checked again.
_LOCATION_FIELDS = ("kind", "url", "sitemap", "start_urls", "scope")


def new_hook_secret() -> str:
    return secrets.token_urlsafe(32)


def hook_writer(caller: str | None) -> Writer:
    return Writer(kind="hook", name=caller)


def checked_spec(fields: dict[str, Any]) -> SourceSpec:
    """A source's definition held to its rules; InvalidInput names the field at fault."""
    try:
        return SourceSpec.model_validate(fields)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        field = str(first["loc"][0]) if first["loc"] else None
        message = str(first["msg"]).removeprefix("Value error, ")
        raise InvalidInput(
            message if field is None else f"{field}: {message}", field=field
        ) from err


def check_credentials(spec: SourceSpec, token: str | None, ssh_key: str | None) -> None:
    """Credentials are a git source's, of the kind its URL uses."""
    if not (token or ssh_key):
        return
    field = "token" if token else "ssh_key"
    if spec.kind != "git":
        raise InvalidInput(f"{field}: a web source takes no credentials", field=field)
    scheme = git_scheme(spec.url)
    if token and scheme not in ("https", "http"):
        raise InvalidInput("token: a token is for git over https", field="token")
    if ssh_key and scheme != "ssh":
        raise InvalidInput("ssh_key: a key is for git over ssh", field="ssh_key")


def git_scheme(url: str) -> str:
    """`https`, `http`, `ssh`, `git`, or `local` for a path (`file://` or a filesystem path)."""
    parts = urlsplit(url)
    if parts.scheme in GIT_SCHEMES or parts.scheme == "file":
        return "local" if parts.scheme == "file" else parts.scheme
    if "://" not in url and SCP_LIKE in url.split(":", 1)[0] and ":" in url:
        return "ssh"
    if "://" in url:
        return parts.scheme or "unknown"
    return "local"


async def check_git_url(url: str, policy: EgressPolicy, *, local_allowed: bool) -> None:
    scheme = git_scheme(url)
    if scheme == "local":
        if not local_allowed:
            raise InvalidInput(
                "url: a local repository path is for the operator on the gateway's machine "
                "only; give a remote URL (https://, ssh://, git://, or user@host:path)",
                field="url",
            )
        path = url.removeprefix("file://")
        if not PurePosixPath(path).is_absolute():
            raise InvalidInput("url: a local repository path must be absolute", field="url")
        return
    if scheme not in GIT_SCHEMES and scheme != "ssh":
        raise InvalidInput(
            f"url: a git remote must be https://, http://, ssh://, git:// or user@host:path, "
            f"not {scheme}://",
            field="url",
        )
    if "://" in url:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    else:  # user@host:path
        host, port = url.split(":", 1)[0].rsplit("@", 1)[1], None
    if not host:
        raise InvalidInput("url: the git remote names no host", field="url")
    try:
        target = httpx.URL(scheme="https", host=host, port=port or GIT_SCHEMES.get(scheme, 22))
    except (httpx.InvalidURL, ValueError) as err:
        raise InvalidInput(f"url: invalid host {host!r}", field="url") from err
    await policy.vet(target, field="url", what="clone from")


class _Signed:
    """A webhook call's body and headers, and what they prove."""

    def __init__(self, body: bytes, headers: Mapping[str, str]) -> None:
        self.body = body
        self.headers = {k.lower(): v for k, v in headers.items()}

    def verifies(self, secret: str) -> bool:
        expected = hmac.new(secret.encode(), self.body, hashlib.sha256).hexdigest()
        signature = self.headers.get(SIGNATURE_HEADER, "").strip()
        gitea = self.headers.get(GITEA_SIGNATURE_HEADER, "").strip()
        token = self.headers.get(TOKEN_HEADER)
        checks = [
            hmac.compare_digest(signature.encode(), f"sha256={expected}".encode()),
            hmac.compare_digest(gitea.encode(), expected.encode()),
            token is not None and hmac.compare_digest(token.encode(), secret.encode()),
        ]
        # Every form is compared (no early return): the time taken says nothing of which.
        return any(checks)

    def refusal(self) -> str:
        if not any(
            h in self.headers for h in (SIGNATURE_HEADER, GITEA_SIGNATURE_HEADER, TOKEN_HEADER)
        ):
            return "unsigned: no X-Hub-Signature-256, X-Gitea-Signature or X-Gitlab-Token"
        return "the signature or token does not match the source's webhook secret"

    def is_ping(self) -> bool:
        return any(self.headers.get(name, "").lower() == value for name, value in PING_EVENTS)

    def payload(self) -> dict[str, Any] | None:
        """The push event's JSON (sent as is, or as the `payload` field of a form), if any."""
        raw = self.body
        if self.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
            values = parse_qs(raw.decode("utf-8", "replace")).get("payload")
            raw = values[0].encode() if values else b""
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


def pushes_branch(source: Source, payload: dict[str, Any] | None) -> bool:
    """Whether a push event concerns what the source follows: a source on a branch or tag
    ignores pushes to others; anything that is not a push with a `ref` starts a sync."""
    ref = payload.get("ref") if payload is not None else None
    if source.kind != "git" or not source.branch or not isinstance(ref, str):
        return True
    return ref in (f"refs/heads/{source.branch}", f"refs/tags/{source.branch}", source.branch)
