"""Dead letters: how they are filed, reading them back, and replaying them onto their
original subjects once the cause is fixed (a missing KB created, a provider back, a bug
deployed away).

A dead letter is the original message (bytes and headers) published to
`dlq.<org>.<original subject>` with the reason and what a list shows of it in `Kbmesh-*`
headers. The org is the one that may see it: an upstream publisher's org for everything that
publisher sent (whichever org its event names), else the org the event names, else none
(`NO_ORG`). So one org's letters are found by subject, on the server, and a list reads
headers only: neither another org's letters nor any body is read to list them.

Letters written by earlier versions (`dlq.<original subject>`, `LEGACY`) name no org in their
subject: the operator's `kbmesh dlq` lists, replays and discards them; no org sees them."""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, replace
from datetime import datetime
from email.header import Header, decode_header
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from services.common.bus.auth import publisher_of
from services.common.messages.events import Event
from services.common.messages.names import (
    DLQ_PREFIX,
    DLQ_STREAM,
    EVENT_SUBJECTS,
    NO_ORG,
    STREAM,
    UPSTREAM_STREAM,
    dlq_subject,
)

ORIGINAL_SUBJECT = "Kbmesh-Original-Subject"
ERROR = "Kbmesh-Error"
ERROR_TYPE = "Kbmesh-Error-Type"
DELIVERED = "Kbmesh-Delivered"
# What a list shows of the event, copied from its body when it was filed.
KB_ID = "Kbmesh-Kb-Id"
DOCUMENT_ID = "Kbmesh-Document-Id"
NAME = "Kbmesh-Name"
LABELS = {KB_ID: "kb_id", DOCUMENT_ID: "document_id", NAME: "name"}
# Every header kbmesh adds starts so; a message's own are never taken for one.
KBMESH_HEADER = "Kbmesh-"
LEGACY = "legacy"

# One header line each, and bounded: a line break would end the header, and the headers must
# fit next to the largest event (services/common/bus/client.py, DEAD_LETTER_HEADROOM).
ERROR_CHARS = 2000
LABEL_CHARS = 512
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Headers of how many letters one read asks for at a time (a KB-scoped key's list reads its
# org's letters until it has enough).
READ_BATCH = 256
# A reader that vanished mid-list leaves its consumer behind this long at most.
READER_IDLE_SECONDS = 30.0
# Letters counted when a list starts may be gone before it reads them (replayed, discarded,
# expired): a fetch that finds none ends the list after this long.
READ_TIMEOUT = 2.0


# --- filing ------------------------------------------------------------------------------


def file_letter(
    subject: str, data: bytes, event: Event | None, reason: str, error_type: str, delivered: int
) -> tuple[str, dict[str, str]]:
    """Where the dead letter of a message on `subject` goes, and the headers that say why and
    what it was (`event`: the message parsed, when it parsed)."""
    fields: dict[str, Any] = (
        {key: getattr(event, key, None) for key in ("org_id", *LABELS.values())}
        if event is not None
        else _body_fields(data)
    )
    publisher = publisher_of(subject)
    org = publisher.org_id if publisher is not None else _id(fields.get("org_id"))
    headers = {
        ORIGINAL_SUBJECT: subject,
        ERROR: _line(reason, ERROR_CHARS),
        ERROR_TYPE: error_type,
        DELIVERED: str(delivered),
    }
    for header, key in LABELS.items():
        value = fields.get(key)
        if isinstance(value, str) and value.strip():
            headers[header] = _line(value, LABEL_CHARS)
    return dlq_subject(org, subject), headers


def _body_fields(data: bytes) -> dict[str, Any]:
    """The top-level fields of a message that did not parse as its event, if it is a JSON
    object at all (an org named there still sees its malformed message)."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _id(value: object) -> str | None:
    return value if isinstance(value, str) and _ID.match(value) else None


def _line(text: str, limit: int) -> str:
    return " ".join(text.split())[:limit]


# --- reading -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeadLetter:
    sequence: int
    subject: str  # the original subject
    org_id: str | None  # who may see it; None: no org (or a letter of an earlier version)
    error_type: str
    error: str
    delivered: int
    time: datetime | None
    size: int  # of the original body
    headers: dict[str, str]
    data: bytes = b""  # the original body; empty where only headers were read
    legacy: bool = False

    @property
    def kb_id(self) -> str | None:
        return self.headers.get(KB_ID)

    @property
    def document_id(self) -> str | None:
        return self.headers.get(DOCUMENT_ID)

    @property
    def name(self) -> str | None:
        return self.headers.get(NAME)

    def summary(self) -> dict[str, object]:
        return {
            "sequence": self.sequence,
            "org_id": self.org_id,
            "subject": self.subject,
            "error_type": self.error_type,
            "error": self.error,
            "delivered": self.delivered,
            "time": self.time.isoformat() if self.time else None,
            "bytes": self.size,
            **({LEGACY: True} if self.legacy else {}),
        }


@dataclass(frozen=True)
class Page:
    letters: list[DeadLetter]  # headers only
    next: int | None  # pass as `after` for the next page; None: nothing follows
    total: int  # letters that match, in all


def parse_subject(dlq: str) -> tuple[str | None, str, bool]:
    """(org, original subject, legacy) of a dead letter's subject."""
    rest = dlq.removeprefix(DLQ_PREFIX)
    org, _, original = rest.partition(".")
    if _is_original(original) and (org == NO_ORG or _ID.match(org)):
        return (None if org == NO_ORG else org), original, False
    return None, rest, True


def _is_original(subject: str) -> bool:
    return subject in EVENT_SUBJECTS or publisher_of(subject) is not None


def _filters(org_id: str | None, subject: str | None) -> list[str]:
    """The subjects of `org_id`'s letters (of `subject`); without an org, everyone's,
    earlier versions' included."""
    if org_id is not None:
        return [dlq_subject(org_id, subject or ">")]
    if subject is None:
        return [f"{DLQ_PREFIX}>"]
    return [f"{DLQ_PREFIX}*.{subject}", f"{DLQ_PREFIX}{subject}"]


async def count_dead_letters(
    js: JetStreamContext, org_id: str | None, subject: str | None = None
) -> int:
    """How many letters `org_id` has (of `subject`), from the stream's per-subject counts:
    nothing is read."""
    total = 0
    for pattern in _filters(org_id, subject):
        info = await js.stream_info(DLQ_STREAM, subjects_filter=pattern)
        total += sum(
            n
            for s, n in (info.state.subjects or {}).items()
            if org_id is None or not parse_subject(s)[2]
        )
    return total


async def list_dead_letters(
    js: JetStreamContext,
    org_id: str | None = None,
    subject: str | None = None,
    *,
    kb_ids: Collection[str] | None = None,
    after: int = 0,
    limit: int = 100,
) -> Page:
    """`org_id`'s dead letters (everyone's without one) after sequence `after`, oldest first,
    at most `limit`: only of the original `subject`, and only those naming one of `kb_ids`
    when given. The server picks the org's letters by subject and hands over their headers
    only, so a list reads what it returns and nothing else; a KB-scoped list reads the
    headers of all its org's letters (the KB is not in the subject), one batch at a time."""
    scoped = kb_ids is not None
    start = 0 if scoped else after  # a scoped list counts its letters before `after` too
    info = await js.add_consumer(
        DLQ_STREAM,
        ConsumerConfig(
            name=f"dlq-read-{uuid.uuid4().hex}",
            filter_subjects=_filters(org_id, subject),
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start else DeliverPolicy.ALL,
            opt_start_seq=start + 1 if start else None,
            ack_policy=AckPolicy.NONE,
            headers_only=True,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=READER_IDLE_SECONDS,
        ),
    )
    found: list[DeadLetter] = []
    before = later = 0  # a scoped list's letters before and after this page
    pending = info.num_pending or 0
    try:
        reader = await js.pull_subscribe_bind(consumer=info.name, stream=DLQ_STREAM)
        try:
            while pending and (scoped or len(found) < limit):
                batch = READ_BATCH if scoped else limit - len(found)
                try:
                    msgs = await reader.fetch(min(batch, pending), timeout=READ_TIMEOUT)
                except TimeoutError:
                    msgs = []
                if not msgs:
                    break  # removed meanwhile (replayed, discarded, expired)
                for msg in msgs:
                    pending = msg.metadata.num_pending or 0
                    letter = _letter(msg)
                    if letter.legacy and org_id is not None:
                        continue  # an earlier version's, whose subject happens to match
                    if kb_ids is not None and letter.kb_id not in kb_ids:
                        continue
                    if letter.sequence <= after:
                        before += 1
                    elif len(found) == limit:
                        later += 1
                    else:
                        found.append(letter)
        finally:
            await reader.unsubscribe()
    finally:
        with contextlib.suppress(Exception):
            await js.delete_consumer(DLQ_STREAM, info.name)
    if scoped:
        total, more = before + len(found) + later, later > 0
    else:
        total = await count_dead_letters(js, org_id, subject)
        more = len(found) == limit and pending > 0
    return Page(letters=found, next=found[-1].sequence if more else None, total=total)


async def get_dead_letter(js: JetStreamContext, sequence: int) -> DeadLetter | None:
    """One letter with its body."""
    try:
        raw = await js.get_msg(DLQ_STREAM, sequence)
    except NotFoundError:
        return None
    headers = _headers(raw.headers)
    return _build(sequence, raw.subject or "", headers, raw.time, raw.data or b"")


def _letter(msg: Msg) -> DeadLetter:
    """A letter read headers only (the server says how large its body is)."""
    headers = _headers(msg.headers)
    meta = msg.metadata
    letter = _build(meta.sequence.stream, msg.subject, headers, meta.timestamp, b"")
    size = headers.get("Nats-Msg-Size", "")
    return replace(letter, size=int(size)) if size.isdigit() else letter


def _build(
    sequence: int, subject: str, headers: dict[str, str], time: object, data: bytes
) -> DeadLetter:
    org_id, original, legacy = parse_subject(subject)
    return DeadLetter(
        sequence=sequence,
        subject=headers.get(ORIGINAL_SUBJECT) or original,
        org_id=org_id,
        error_type=headers.get(ERROR_TYPE, ""),
        error=headers.get(ERROR, ""),
        delivered=int(headers.get(DELIVERED, "0") or 0),
        time=time if isinstance(time, datetime) else None,
        size=len(data),
        headers=headers,
        data=data,
        legacy=legacy,
    )


def _headers(raw: dict[str, Any] | None) -> dict[str, str]:
    return {name: _header_text(value) for name, value in (raw or {}).items()}


def _header_text(value: object) -> str:
    """nats-py reads a stored message's headers with the e-mail parser, which hands back a
    value with non-ASCII bytes (an error text in any language) as a `Header` object:
    turn it back into the UTF-8 text that was written."""
    if not isinstance(value, Header):
        return str(value)
    parts = decode_header(value)
    raw = b"".join(part if isinstance(part, bytes) else part.encode() for part, _ in parts)
    return raw.decode("utf-8", errors="replace")


# --- acting on them ------------------------------------------------------------------------


async def replay(js: JetStreamContext, letter: DeadLetter) -> None:
    """Publish the original bytes and headers to the original subject, then remove the
    dead letter. The message id is new: the original one may still be inside JetStream's
    de-duplication window, which would silently drop the replay."""
    if len(letter.data) != letter.size:  # listed, headers only: read the body now
        found = await get_dead_letter(js, letter.sequence)
        if found is None:
            raise NotFoundError(description=f"dead letter {letter.sequence} is gone")
        letter = found
    headers = {
        k: v
        for k, v in letter.headers.items()
        if not k.startswith(KBMESH_HEADER) and k not in ("Nats-Msg-Id", "Nats-Msg-Size")
    }
    headers["Nats-Msg-Id"] = (
        f"replay-{letter.sequence}-{letter.time.timestamp() if letter.time else 0}"
    )
    # An upstream publisher's event goes back among publishers' events.
    stream = UPSTREAM_STREAM if publisher_of(letter.subject) else STREAM
    await js.publish(letter.subject, letter.data, headers=headers, stream=stream)
    await js.delete_msg(DLQ_STREAM, letter.sequence)


async def discard(js: JetStreamContext, letter: DeadLetter) -> None:
    """Remove the dead letter without replaying it (its cause is known and will not be fixed:
    a malformed event from a test publisher, say)."""
    await js.delete_msg(DLQ_STREAM, letter.sequence)
