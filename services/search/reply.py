"""Fitting a reply into one bus message. NATS refuses a message over the server's
`max_payload` (1 MiB by default), and the caller would only see a timeout; so a reply that
would not fit is shortened here, and says so with `truncated`.

Contents are cut first (evenly, by bytes); only when the hits' other fields alone are too
large are hits dropped: neighbour chunks first, then matched chunks from the lowest rank.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

from services.common.messages.queries import SearchHit

# Room for the reply envelope, headers and JSON escaping of what is measured.
MARGIN_BYTES = 8 * 1024
# A cut content says so at its end.
ELLIPSIS = " …"

R = TypeVar("R", bound=BaseModel)


def fitted_json(reply: BaseModel, max_bytes: int) -> bytes:
    """The JSON of `reply`, or of its `fit` when it is too large: serialised once when it
    fits, which is nearly always."""
    body = reply.model_dump_json().encode()
    if len(body) <= _budget(max_bytes):
        return body
    return fit(reply, max_bytes).model_dump_json().encode()


def _budget(max_bytes: int) -> int:
    return max(1024, max_bytes - MARGIN_BYTES)


def fit(reply: R, max_bytes: int, hits_field: str = "hits") -> R:
    """`reply` unchanged when it fits in `max_bytes`, else a copy with `truncated=True` whose
    hits are shortened until it does."""
    budget = _budget(max_bytes)
    if _size(reply) <= budget:
        return reply
    hits: list[SearchHit] = list(getattr(reply, hits_field))
    # What the reply weighs without any content: what the contents may share. Hits are
    # dropped until that fits: neighbours first, then matched hits from the lowest rank.
    order = sorted(
        range(len(hits)),
        key=lambda i: (hits[i].is_matched, -(hits[i].rank or 0), -i),
    )
    kept = set(range(len(hits)))
    while True:
        bare = [hits[i].model_copy(update={"content": ""}) for i in sorted(kept)]
        if not bare or _size(_with(reply, hits_field, bare)) <= budget:
            break
        kept.discard(order.pop(0))
    hits = [hits[i] for i in sorted(kept)]
    room = budget - _size(_with(reply, hits_field, bare))
    share = room // max(1, len(hits))
    while True:
        cut = [h.model_copy(update={"content": _cut(h.content, share)}) for h in hits]
        candidate = _with(reply, hits_field, cut)
        if _size(candidate) <= budget or share == 0:
            return candidate
        share //= 2  # escaping made the contents larger than their raw bytes


def _with(reply: R, hits_field: str, hits: list[SearchHit]) -> R:
    return reply.model_copy(update={hits_field: hits, "truncated": True})


def _size(model: BaseModel) -> int:
    return len(model.model_dump_json().encode())


def _cut(text: str, max_bytes: int) -> str:
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return text
    keep = max(0, max_bytes - len(ELLIPSIS.encode()))
    return raw[:keep].decode("utf-8", errors="ignore") + ELLIPSIS
