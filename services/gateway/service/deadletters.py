"""Dead letters as a caller sees them: only its org's, and with a KB-scoped key only those
naming one of its KBs. A message that is not a kbmesh event (no org to tell) is left to the
operators' `kbmesh dlq`."""

from __future__ import annotations

import base64

from services.common.bus import deadletters
from services.common.bus.client import Bus
from services.common.bus.deadletters import DeadLetter
from services.common.domain.errors import NotFound
from services.gateway.auth import Principal
from services.gateway.schemas import DeadLetterBody, DeadLetterList, DeadLetterView

# What `GET /v1/dead-letters/{sequence}` shows of a body: enough to see what was wrong.
BODY_SHOWN = 64 * 1024


class DeadLetters:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def list(self, p: Principal, subject: str | None, limit: int) -> DeadLetterList:
        letters = await deadletters.list_dead_letters(
            self.bus.js, subject, limit, where=lambda d: _visible(p, d)
        )
        # Counted, not shown: which org such a message came from cannot be told.
        orgless = await deadletters.list_dead_letters(
            self.bus.js, subject, limit=1_000_000, where=lambda d: "org_id" not in d.event
        )
        return DeadLetterList(
            items=[_view(d) for d in letters], total=len(letters), without_org=len(orgless)
        )

    async def get(self, p: Principal, sequence: int) -> DeadLetterBody:
        letter = await self._visible_letter(p, sequence)
        shown = letter.data[:BODY_SHOWN]
        try:
            body, encoding = shown.decode("utf-8"), "text"
        except UnicodeDecodeError:
            body, encoding = base64.b64encode(shown).decode(), "base64"
        return DeadLetterBody(
            **_view(letter).model_dump(),
            body=body,
            body_encoding=encoding,  # type: ignore[arg-type]
            body_truncated=len(letter.data) > BODY_SHOWN,
        )

    async def discard(self, p: Principal, sequence: int) -> DeadLetterView:
        """Remove one dead letter without replaying it."""
        p.check_write()
        letter = await self._visible_letter(p, sequence)
        await deadletters.discard(self.bus.js, letter)
        return _view(letter)

    async def _visible_letter(self, p: Principal, sequence: int) -> DeadLetter:
        letter = await deadletters.get_dead_letter(self.bus.js, sequence)
        if letter is None or not _visible(p, letter):
            raise NotFound(f"dead letter {sequence} not found", field="sequence")
        return letter

    async def replay(self, p: Principal, sequence: int) -> DeadLetterView:
        """Republish one dead letter onto its original subject and remove it."""
        p.check_write()
        letter = await self._visible_letter(p, sequence)
        await deadletters.replay(self.bus.js, letter)
        return _view(letter)


def _visible(p: Principal, letter: DeadLetter) -> bool:
    event = letter.event
    if event.get("org_id") != p.org_id:
        return False
    return p.kb_ids is None or event.get("kb_id") in p.kb_ids


def _view(letter: DeadLetter) -> DeadLetterView:
    event = letter.event

    def text(key: str) -> str | None:
        value = event.get(key)
        return value if isinstance(value, str) else None

    return DeadLetterView(
        sequence=letter.sequence,
        subject=letter.subject,
        error_type=letter.error_type,
        error=letter.error,
        delivered=letter.delivered,
        time=letter.time,
        document_id=text("document_id"),
        kb_id=text("kb_id"),
        name=text("name"),
    )
