"""Dead letters as a caller sees them: only those filed under its org, and with a KB-scoped
key only those naming one of its KBs. A message that names no org is left to the operators'
`kbmesh dlq`."""

from __future__ import annotations

import base64

from services.common.bus import deadletters
from services.common.bus.client import Bus
from services.common.bus.deadletters import DeadLetter
from services.common.domain.errors import NotFound
from services.common.messages.names import NO_ORG
from services.gateway.auth import Principal
from services.gateway.schemas import DeadLetterBody, DeadLetterList, DeadLetterView

# What `GET /v1/dead-letters/{sequence}` shows of a body: enough to see what was wrong.
BODY_SHOWN = 64 * 1024


class DeadLetters:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def list(
        self, p: Principal, subject: str | None, limit: int, after: int = 0
    ) -> DeadLetterList:
        page = await deadletters.list_dead_letters(
            self.bus.js, p.org_id, subject, kb_ids=p.kb_ids, after=after, limit=limit
        )
        # Counted, not shown: which org such a message came from cannot be told.
        orgless = await deadletters.count_dead_letters(self.bus.js, NO_ORG, subject)
        return DeadLetterList(
            items=[_view(d) for d in page.letters],
            total=page.total,
            next=page.next,
            without_org=orgless,
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
    """The org a letter was filed under, never the org its body names (an upstream
    publisher's event naming another org is its own org's letter)."""
    if letter.org_id != p.org_id:
        return False
    return p.kb_ids is None or letter.kb_id in p.kb_ids


def _view(letter: DeadLetter) -> DeadLetterView:
    return DeadLetterView(
        sequence=letter.sequence,
        subject=letter.subject,
        error_type=letter.error_type,
        error=letter.error,
        delivered=letter.delivered,
        time=letter.time,
        document_id=letter.document_id,
        kb_id=letter.kb_id,
        name=letter.name,
    )
