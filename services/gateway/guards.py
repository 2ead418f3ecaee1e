"""Scope rules for what a KB-scoped key may write and see beyond single documents: the tags
its KBs match, and the ids of other KBs that a document or a hit would otherwise show."""

from __future__ import annotations

from services.common.errors import Forbidden
from services.common.models import KB_TAG_PREFIX, DocumentRecord, KnowledgeBase
from services.gateway.auth import Principal


def check_kb_tags_in_scope(
    p: Principal, kb_id: str, tag_ids: list[str], documents: list[DocumentRecord]
) -> None:
    """A scoped key may give its KB only tags that pull in documents it can already read: a
    KB's tags are membership, so `kb:<another KB>` or a tag that documents of other KBs carry
    would make those documents searchable and readable through this KB."""
    if p.kb_ids is None:
        return
    for tag in tag_ids:
        if tag.startswith(KB_TAG_PREFIX) and tag.removeprefix(KB_TAG_PREFIX) not in p.kb_ids:
            raise Forbidden(
                f"tag_ids: {tag!r} names a knowledge base outside this API key's scope",
                field="tag_ids",
            )
    wanted = set(tag_ids)
    for record in documents:
        if wanted & set(record.tags) and not record.visible_in(p.kb_ids):
            raise Forbidden(
                "tag_ids: these tags would add documents this API key cannot read to "
                f"knowledge base {kb_id!r}",
                field="tag_ids",
            )


def visible_kb_ids(p: Principal, kb_ids: list[str]) -> list[str]:
    return kb_ids if p.kb_ids is None else [k for k in kb_ids if k in p.kb_ids]


def visible_tags(p: Principal, tags: list[str]) -> list[str]:
    """Tags without the implicit tags of KBs outside the key's scope (their ids included)."""
    if p.kb_ids is None:
        return tags
    return [
        t
        for t in tags
        if not t.startswith(KB_TAG_PREFIX) or t.removeprefix(KB_TAG_PREFIX) in p.kb_ids
    ]


def kb_rank(kbs: list[KnowledgeBase], kb_id: str) -> int:
    """1-based position of `kb_id` among `kbs` in creation order (ties by id), so that every
    gateway that races to create KBs agrees which ones are over the limit."""
    ordered = sorted(kbs, key=lambda k: (k.created_at, k.kb_id))
    return next(i for i, k in enumerate(ordered, 1) if k.kb_id == kb_id)
