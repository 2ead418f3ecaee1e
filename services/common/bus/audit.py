"""The audit trail: every write, delete, KB change and key change, with who made it, every
upload that failed after it was accepted, and every restore, on the subject
`audit.<org_id>.<kind>` (kind: document, kb, key, backup, source).

Entries are kept in the JetStream stream `KBMESH_AUDIT` (file storage, its own limits:
`KBMESH_AUDIT__MAX_AGE_DAYS`, `KBMESH_AUDIT__MAX_BYTES`; the oldest entries go first), apart
from the work stream, so replaying or trimming work never touches the record of who did it.
Ingest writes the document entries when it applies a change (whoever sent it: the gateway or
an upstream publisher) and when it gives up on an upload (`failed`, with the reason); the
gateway writes KB entries, and whoever creates a key its entry. `kbmesh restore` carries the
trail over from the archive, then records the restore itself (kind `backup`) and every key it
brings back (action `restored`).
Org admins read them with `GET /v1/audit` or `kbmesh audit`.

Each service may write only its own kind (services/common/bus/auth.py), but for every
org, since it serves them all; so a read trusts nothing it finds: an entry that does not
parse, or names another org or kind than its subject, is left out and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from pydantic import Field, ValidationError

from services.common.domain.models import Writer
from services.common.messages.events import Event
from services.common.messages.names import AUDIT_PREFIX, AUDIT_STREAM
from services.common.settings import AuditSettings

log = logging.getLogger("kbmesh.audit")

AuditKind = Literal["document", "kb", "key", "backup", "source"]
AuditAction = Literal["uploaded", "changed", "deleted", "created", "failed", "restored", "refused"]
MAX_READ = 1000


class AuditEntry(Event):
    """One change and its writer. `event_id` is derived from the change's own event, so a
    redelivered change is recorded once (JetStream de-duplication)."""

    kind: AuditKind
    action: AuditAction
    writer: Writer
    document_id: str | None = None
    kb_id: str | None = Field(None, description="the KB changed, or the KB uploaded into")
    kb_ids: list[str] = Field(
        default_factory=list, description="for a document: the KBs it is in after the change"
    )
    key_id: str | None = Field(None, description="for a key: its id")
    revision: int | None = None
    name: str | None = Field(
        None, description="the document's, KB's or key's name; for a backup, the archive's"
    )
    error: str | None = Field(
        None,
        description="for `failed`: why the upload was not applied; for `refused`: why a "
        "webhook call was refused",
    )
    source_id: str | None = Field(None, description="for a source: its id")


AuditSink = Callable[[AuditEntry], Awaitable[None]]


def audit_subject(org_id: str, kind: str) -> str:
    return f"{AUDIT_PREFIX}{org_id}.{kind}"


def stream_config(settings: AuditSettings, replicas: int = 1) -> StreamConfig:
    return StreamConfig(
        name=AUDIT_STREAM,
        subjects=[f"{AUDIT_PREFIX}>"],
        storage=StorageType.FILE,
        max_age=settings.max_age_days * 86400,
        max_bytes=settings.max_bytes,
        duplicate_window=120.0,
        num_replicas=replicas,
    )


async def declare_audit_stream(
    js: JetStreamContext, settings: AuditSettings, replicas: int = 1
) -> None:
    config = stream_config(settings, replicas)
    try:
        await js.add_stream(config)
    except BadRequestError:
        await js.update_stream(config)


def sink(js: Callable[[], JetStreamContext]) -> AuditSink:
    """Publishes entries durably (waits for the stream's ack)."""

    async def publish(entry: AuditEntry) -> None:
        await js().publish(
            audit_subject(entry.org_id, entry.kind),
            entry.model_dump_json().encode(),
            headers={"Nats-Msg-Id": entry.event_id},
            stream=AUDIT_STREAM,
        )

    return publish


@dataclass(frozen=True)
class AuditQuery:
    """Filters; every one given must hold. `writer` is a key id, a key or publisher name, or
    a writer kind (`local`, `bus`, `operator`, `key`)."""

    writer: str | None = None
    kind: AuditKind | None = None
    action: AuditAction | None = None
    document_id: str | None = None
    kb_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    limit: int = 100

    def accepts(self, entry: AuditEntry) -> bool:
        return (
            (self.writer is None or entry.writer.matches(self.writer))
            and (self.action is None or entry.action == self.action)
            and (self.document_id is None or entry.document_id == self.document_id)
            and (self.kb_id is None or self.kb_id in (entry.kb_id, *entry.kb_ids))
            and (self.since is None or entry.occurred_at >= self.since)
            and (self.until is None or entry.occurred_at <= self.until)
        )


@dataclass
class AuditRead:
    """What a read found: the entries, and how many it left out because they could not be
    trusted (not an entry, or not of the org and kind their subject names)."""

    entries: list[AuditEntry] = field(default_factory=list)
    skipped: int = 0


async def read_audit(js: JetStreamContext, org_id: str, query: AuditQuery) -> AuditRead:
    """The org's entries that `query` accepts, oldest first, at most `query.limit`. Only the
    org's own subjects are read (the org id is a plain id, no wildcard)."""
    subject = audit_subject(org_id, query.kind or "*")
    read = AuditRead()
    sequence = 1
    if query.since is not None:
        sequence = await _first_at(js, query.since)
    while len(read.entries) < min(query.limit, MAX_READ):
        try:
            raw = await js.get_msg(AUDIT_STREAM, seq=sequence, subject=subject, next=True)
        except NotFoundError:
            break
        if raw.seq is None:
            break
        sequence = raw.seq + 1
        entry = _trusted(raw, org_id)
        if entry is None:
            read.skipped += 1
            continue
        if query.until is not None and entry.occurred_at > query.until:
            break
        if query.accepts(entry):
            read.entries.append(entry)
    if read.skipped:
        log.warning("audit_entries_skipped org_id=%s skipped=%d", org_id, read.skipped)
    return read


def _trusted(raw: RawStreamMsg, org_id: str) -> AuditEntry | None:
    """The entry in `raw` if it is one, of `org_id`, on the subject of its org and kind."""
    try:
        entry = AuditEntry.model_validate_json(raw.data or b"")
    except (ValidationError, ValueError, RecursionError):
        return None
    if entry.org_id != org_id or raw.subject != audit_subject(org_id, entry.kind):
        return None
    return entry


async def _first_at(js: JetStreamContext, since: datetime) -> int:
    """The first sequence stored at or after `since`. The server's own time of storing is
    used, not the entry's: it grows with the sequence, and no writer can set it."""
    info = await js.stream_info(AUDIT_STREAM)
    low, high = info.state.first_seq, info.state.last_seq
    while low < high:
        middle = (low + high) // 2
        try:
            raw = await js.get_msg(AUDIT_STREAM, seq=middle, subject=f"{AUDIT_PREFIX}>", next=True)
        except NotFoundError:
            return high
        if raw.time is not None and raw.time < since:
            low = (raw.seq or middle) + 1
        else:
            high = middle
    return low
