"""Who may see and change what: the access rules of API-key scopes over documents and tags.

A KB-scoped key sees only documents in (or tagged into) its KBs, may change only documents
wholly inside its scope, and cannot tag a document into a KB outside it. Anything outside the
scope is reported as not found, so a scoped key never learns that it exists."""

from __future__ import annotations

from services.common.errors import Forbidden, InvalidInput, NotFound
from services.common.models import DocumentRecord, KnowledgeBase, check_id
from services.gateway.auth import Principal


def visible(p: Principal, record: DocumentRecord) -> bool:
    return record.in_scope(p.kb_ids)


def check_document_write(p: Principal, record: DocumentRecord) -> None:
    p.check_write()
    if p.kb_ids is not None and not set(record.kb_ids) <= set(p.kb_ids):
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


def key_safe(value: str) -> bool:
    """Whether `value` can be a registry key segment (else it names nothing stored)."""
    try:
        check_id(value, "id")
    except InvalidInput:
        return False
    return True
