"""Who may see and change what: the access rules of API-key scopes over documents and tags.

A KB-scoped key sees only documents in (or tagged into) its KBs, may change only documents
wholly inside its scope, cannot tag a document into a KB outside it, cannot give its KBs tags
that could ever pull in documents it cannot read, and sees no ids of KBs outside it.
Anything outside the scope is reported as not found, so a scoped key never learns that it
exists."""

from __future__ import annotations

from services.common.domain.errors import Forbidden, NotFound
from services.common.domain.ids import is_id
from services.common.domain.models import KB_TAG_PREFIX, DocumentRecord, KnowledgeBase
from services.gateway.auth import Principal
from services.gateway.catalog import DocumentSummary


def visible(p: Principal, record: DocumentRecord | DocumentSummary) -> bool:
    return record.in_scope(p.kb_ids)


def check_document_write(p: Principal, record: DocumentRecord) -> None:
    p.check_write()
    if not record.writable_in(p.kb_ids):
        raise NotFound(f"document {record.document_id!r} not found", field="document_id")


def check_tag_scope(p: Principal, kbs: list[KnowledgeBase], tags: list[str]) -> None:
    """Tags are membership: a KB-scoped key cannot tag a document into a KB outside its
    scope (and is not told which one)."""
    if p.kb_ids is None or not tags:
        return
    for kb in kbs:
        if not p.can_see(kb.kb_id) and kb.matches(tags):
            raise Forbidden(
                "these tags would add the document to a knowledge base outside "
                "this API key's scope",
                field="tags",
            )


def check_kb_tags_in_scope(p: Principal, kb_id: str, added: list[str]) -> None:
    """A scoped key may add to its KB's tag_ids only the implicit tags of KBs in its scope
    (`kb:<id>`): a KB's tags are membership, and any other tag pulls in every document that
    carries it — today's and whichever anyone in the org tags with it later, which the key
    may not read. Removing tags only narrows the KB and is always allowed."""
    if p.kb_ids is None:
        return
    for tag in added:
        if not (tag.startswith(KB_TAG_PREFIX) and tag.removeprefix(KB_TAG_PREFIX) in p.kb_ids):
            raise Forbidden(
                f"tag_ids: an API key limited to some knowledge bases cannot add {tag!r} to "
                f"knowledge base {kb_id!r}: documents tagged with it later would become "
                "readable through this key (use an org-wide key to change membership rules)",
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


def key_safe(value: str) -> bool:
    """Whether `value` can be a registry key segment (else it names nothing stored)."""
    return is_id(value)
