"""Dead letters: reading them back, and replaying them onto their original subjects once
the cause is fixed (a missing KB created, a provider back, a bug deployed away)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from email.header import Header, decode_header
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from services.common.messages.events import DLQ_PREFIX, DLQ_STREAM, STREAM

KBMESH_HEADERS = (
    "Kbmesh-Original-Subject",
    "Kbmesh-Error",
    "Kbmesh-Error-Type",
    "Kbmesh-Delivered",
)


@dataclass(frozen=True)
class DeadLetter:
    sequence: int
    subject: str  # the original subject
    error_type: str
    error: str
    delivered: int
    time: datetime | None
    data: bytes
    headers: dict[str, str]

    @property
    def event(self) -> dict[str, Any]:
        """The original event's JSON object; empty when the message was not one (malformed
        input is dead-lettered too)."""
        try:
            value = json.loads(self.data)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    def summary(self) -> dict[str, object]:
        return {
            "sequence": self.sequence,
            "subject": self.subject,
            "error_type": self.error_type,
            "error": self.error,
            "delivered": self.delivered,
            "time": self.time.isoformat() if self.time else None,
            "bytes": len(self.data),
        }


async def list_dead_letters(
    js: JetStreamContext,
    subject: str | None = None,
    limit: int = 100,
    where: Callable[[DeadLetter], bool] | None = None,
) -> list[DeadLetter]:
    """Dead letters oldest first, optionally only those of one original subject and those
    `where` accepts."""
    info = await js.stream_info(DLQ_STREAM)
    found: list[DeadLetter] = []
    if not info.state.messages:
        return found
    for sequence in range(info.state.first_seq, info.state.last_seq + 1):
        letter = await get_dead_letter(js, sequence)
        if letter is None or (subject and letter.subject != subject):
            continue
        if where is not None and not where(letter):
            continue
        found.append(letter)
        if len(found) >= limit:
            break
    return found


async def get_dead_letter(js: JetStreamContext, sequence: int) -> DeadLetter | None:
    try:
        raw = await js.get_msg(DLQ_STREAM, sequence)
    except NotFoundError:
        return None
    headers = {name: _header_text(value) for name, value in (raw.headers or {}).items()}
    original = headers.get("Kbmesh-Original-Subject") or (raw.subject or "").removeprefix(
        DLQ_PREFIX
    )
    return DeadLetter(
        sequence=sequence,
        subject=original,
        error_type=headers.get("Kbmesh-Error-Type", ""),
        error=headers.get("Kbmesh-Error", ""),
        delivered=int(headers.get("Kbmesh-Delivered", "0") or 0),
        time=raw.time if isinstance(getattr(raw, "time", None), datetime) else None,
        data=raw.data or b"",
        headers=headers,
    )


def _header_text(value: object) -> str:
    """nats-py reads a stored message's headers with the e-mail parser, which hands back a
    value with non-ASCII bytes (an error text in any language) as a `Header` object:
    turn it back into the UTF-8 text that was written."""
    if not isinstance(value, Header):
        return str(value)
    parts = decode_header(value)
    raw = b"".join(part if isinstance(part, bytes) else part.encode() for part, _ in parts)
    return raw.decode("utf-8", errors="replace")


async def replay(js: JetStreamContext, letter: DeadLetter) -> None:
    """Publish the original bytes and headers to the original subject, then remove the
    dead letter. The message id is new: the original one may still be inside JetStream's
    de-duplication window, which would silently drop the replay."""
    headers = {
        k: v for k, v in letter.headers.items() if k not in KBMESH_HEADERS and k != "Nats-Msg-Id"
    }
    headers["Nats-Msg-Id"] = (
        f"replay-{letter.sequence}-{letter.time.timestamp() if letter.time else 0}"
    )
    await js.publish(letter.subject, letter.data, headers=headers, stream=STREAM)
    await js.delete_msg(DLQ_STREAM, letter.sequence)


async def discard(js: JetStreamContext, letter: DeadLetter) -> None:
    """Remove the dead letter without replaying it (its cause is known and will not be fixed:
    a malformed event from a test publisher, say)."""
    await js.delete_msg(DLQ_STREAM, letter.sequence)
