"""REST: messages that could not be processed, and replaying them once the cause is fixed."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from services.gateway.api.deps import Caller, Letters
from services.gateway.api.routing import StrictBodyRoute
from services.gateway.schemas import DeadLetterBody, DeadLetterList, DeadLetterView

router = APIRouter(prefix="/v1/dead-letters", tags=["dead letters"], route_class=StrictBodyRoute)


# JetStream numbers messages from 1 with unsigned 64-bit integers.
MAX_SEQUENCE = 2**63 - 1
Sequence = Annotated[int, Path(ge=1, le=MAX_SEQUENCE, description="the dead letter's sequence")]


@router.get("")
async def list_dead_letters(
    letters: Letters,
    caller: Caller,
    subject: Annotated[
        str | None,
        Query(
            description="only this original subject, e.g. `doc.uploaded`",
            max_length=300,
            # Dot-separated names, no wildcards: it becomes part of a NATS subject filter.
            pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    after: Annotated[
        int,
        Query(ge=0, le=MAX_SEQUENCE, description="the `next` of the previous page"),
    ] = 0,
) -> DeadLetterList:
    """The caller's dead letters, oldest first: the original subject and why it failed. A
    page holds at most `limit`; `next` is set when more follow."""
    return await letters.list(caller, subject, limit, after)


@router.get("/{sequence}")
async def get_dead_letter(sequence: Sequence, letters: Letters, caller: Caller) -> DeadLetterBody:
    """One dead letter with the message's body, to see what was wrong with it."""
    return await letters.get(caller, sequence)


@router.delete("/{sequence}")
async def discard_dead_letter(
    sequence: Sequence, letters: Letters, caller: Caller
) -> DeadLetterView:
    """Remove the dead letter without replaying it (its cause will not be fixed)."""
    return await letters.discard(caller, sequence)


@router.post("/{sequence}/replay", status_code=202)
async def replay_dead_letter(
    sequence: Sequence, letters: Letters, caller: Caller
) -> DeadLetterView:
    """Publish the message again on its original subject and remove the dead letter."""
    return await letters.replay(caller, sequence)
