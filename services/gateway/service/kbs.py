"""Knowledge bases: their definitions (written here: the gateway owns the KB API, and
announces every change with `kb.changed`), resolution by id or name, and their views."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from services.common.bus import Bus
from services.common.egress import egress_policy
from services.common.embedders import model_limits
from services.common.errors import Conflict, InvalidInput, NotFound, Transient
from services.common.events import KbChanged, Subject
from services.common.models import (
    COLLECTION_PREFIX,
    DocStatus,
    DocumentRecord,
    IndexEntry,
    KBStatus,
    KnowledgeBase,
    ServingIndex,
    new_id,
    utcnow,
)
from services.common.registry import Registries
from services.common.settings import Settings
from services.gateway.auth import Principal
from services.gateway.modelcheck import check_model
from services.gateway.schemas import (
    Ack,
    KbCreate,
    KbDocumentView,
    KbList,
    KbStats,
    KbUpdate,
    KbView,
    Page,
)
from services.gateway.service.access import check_kb_tags_in_scope, kb_rank, key_safe

# Derives other orgs' default KB ids (see `KnowledgeBases.default_id`).
DEFAULT_KB_NAMESPACE = uuid.UUID("0b3f6c52-2d7e-4f0a-9a43-5c1e8d7b6a29")
KB_CAS_ATTEMPTS = 20
REINDEX_FIELDS = ("chunker", "chunk_size", "chunk_overlap", "embedding_model", "api_base")


class KnowledgeBases:
    def __init__(self, bus: Bus, registries: Registries, settings: Settings) -> None:
        self.bus = bus
        self.reg = registries
        self.settings = settings
        self._locks: dict[str, asyncio.Lock] = {}

    def default_id(self, org_id: str) -> str:
        """The id of an org's default KB. KB ids must be unique across orgs: collections,
        index entries and point ids are keyed by KB id alone, so a default KB shared by id
        would let one org overwrite, count or drop another's vectors. The configured
        default org keeps the plain name as id; every other org gets one derived from it."""
        if org_id == self.settings.default_org:
            return self.settings.default_kb
        return uuid.uuid5(DEFAULT_KB_NAMESPACE, f"{org_id}/{self.settings.default_kb}").hex

    async def ensure_default(self, org_id: str) -> KnowledgeBase:
        key = f"{org_id}.{self.default_id(org_id)}"
        kb = await self.reg.kbs.get(key)
        if kb is not None:
            return kb
        kb = KnowledgeBase(
            org_id=org_id,
            kb_id=self.default_id(org_id),
            name=self.settings.default_kb,
            description="Created on first start.",
            embedding_model=self.settings.default_model,
        )
        try:
            await self.reg.kbs.create(key, kb)
        except Conflict:
            return await self.reg.kbs.get(key) or kb
        await self.bus.publish(
            Subject.KB_CHANGED, KbChanged(org_id=org_id, kb_id=kb.kb_id, change="created")
        )
        return kb

    async def resolve(self, p: Principal, ref: str, *, write: bool = False) -> KnowledgeBase:
        """A KB id or name, within the caller's org and scope (else 404)."""
        key = f"{p.org_id}.{ref}"
        # Reads resolve from the live mirror (as names already do); writes from the bucket.
        lookup = self.reg.kbs.get if write else self.reg.kbs.lookup
        kb = await lookup(key) if key_safe(ref) else None
        if kb is None:
            kb = next((k for k in await self.reg.kbs.list(f"{p.org_id}.") if k.name == ref), None)
        if kb is None and ref == self.settings.default_kb and p.kb_ids is None:
            if p.read_only:  # a read must not create anything
                raise NotFound(f"knowledge base {ref!r} not found", field="kb_id")
            kb = await self.ensure_default(p.org_id)
        if kb is None or not p.can_see(kb.kb_id):
            raise NotFound(f"knowledge base {ref!r} not found", field="kb_id")
        p.check_kb(kb.kb_id, write=write)
        return kb

    async def create(self, p: Principal, body: KbCreate) -> KbView:
        p.check_org_wide_write()
        fields = body.model_dump(exclude_none=True)
        fields.setdefault("embedding_model", self.settings.default_model)
        kb = KnowledgeBase(org_id=p.org_id, kb_id=new_id(), **fields)
        self._check_count(await self.reg.kbs.list(f"{p.org_id}."), body.name)
        await asyncio.to_thread(validate_kb, kb)
        await check_model(kb.embedding_model, kb.api_base, egress_policy(self.settings))
        if kb.rerank_api_base:
            await egress_policy(self.settings).check_url(
                kb.rerank_api_base, field="rerank_api_base", what="call the rerank model at"
            )
        # Check and create under the org's lock (one gateway), then check the rank among
        # what exists (gateways racing each other agree on who is over the limit).
        async with self._locks.setdefault(p.org_id, asyncio.Lock()):
            self._check_count(await self.reg.kbs.list(f"{p.org_id}."), body.name)
            await self.reg.kbs.create(f"{p.org_id}.{kb.kb_id}", kb)
        if kb_rank(await self.reg.kbs.list(f"{p.org_id}."), kb.kb_id) > self.settings.kb_limit:
            await self.reg.kbs.delete(f"{p.org_id}.{kb.kb_id}")
            raise self._limit_reached()
        await self.bus.publish(
            Subject.KB_CHANGED, KbChanged(org_id=p.org_id, kb_id=kb.kb_id, change="created")
        )
        return await self.view(kb)

    def _check_count(self, existing: list[KnowledgeBase], name: str) -> None:
        if len(existing) >= self.settings.kb_limit:
            raise self._limit_reached()
        if any(k.name == name for k in existing):
            raise Conflict(f"a knowledge base named {name!r} exists", field="name")

    def _limit_reached(self) -> Conflict:
        return Conflict(
            f"this org already has {self.settings.kb_limit} knowledge bases (KBMESH_KB_LIMIT)"
        )

    async def page(
        self, p: Principal, skip: int = 0, limit: int = 50, name_search: str | None = None
    ) -> KbList:
        kbs = [k for k in await self.reg.kbs.list(f"{p.org_id}.") if p.can_see(k.kb_id)]
        if name_search:
            kbs = [k for k in kbs if name_search.lower() in k.name.lower()]
        kbs.sort(key=lambda k: k.created_at)
        page = kbs[skip : skip + limit]
        views = await asyncio.gather(*(self.view(k) for k in page))
        return KbList(items=list(views), total=len(kbs), skip=skip, limit=limit)

    async def get(self, p: Principal, ref: str) -> KbView:
        return await self.view(await self.resolve(p, ref))

    async def update(self, p: Principal, ref: str, body: KbUpdate) -> KbView:
        kb = await self.resolve(p, ref, write=True)
        changes = body.model_dump(exclude_unset=True)
        if "name" in changes and changes["name"] is None:
            raise InvalidInput("name cannot be null", field="name")
        if changes.get("name") and changes["name"] != kb.name:
            others = await self.reg.kbs.list(f"{p.org_id}.")
            if any(k.name == changes["name"] for k in others):
                raise Conflict(f"a knowledge base named {changes['name']!r} exists", field="name")
        nullable = ("api_base", "rerank_model", "rerank_api_base")
        update = {k: v for k, v in changes.items() if v is not None or k in nullable}
        added = sorted(set(update.get("tag_ids", kb.tag_ids)) - set(kb.tag_ids))
        if added:
            check_kb_tags_in_scope(
                p, kb.kb_id, added, await self.reg.documents.list(f"{p.org_id}.")
            )
        indexed = bool(await self.reg.index.list(f"{kb.kb_id}."))

        def apply(current: KnowledgeBase) -> KnowledgeBase:
            updated = current.model_copy(update=update)
            validate_kb(updated)
            if any(getattr(updated, f) != getattr(current, f) for f in REINDEX_FIELDS):
                updated.settings_version = current.settings_version + 1
                updated.status = KBStatus.pending_reindex
            if (updated.embedding_model, updated.api_base) != (
                current.embedding_model,
                current.api_base,
            ):
                # Other vectors need another collection. The current one keeps answering
                # searches, with its own model, until embed has built the new one.
                updated.index_generation = current.index_generation + 1
                if indexed:
                    updated.serving = current.serving or ServingIndex(
                        generation=current.index_generation,
                        embedding_model=current.embedding_model,
                        api_base=current.api_base,
                    )
            updated.updated_at = utcnow()
            return updated

        # Off the loop: the first remote model lookup imports litellm (seconds).
        checked = await asyncio.to_thread(apply, kb)
        if (checked.embedding_model, checked.api_base) != (kb.embedding_model, kb.api_base):
            await check_model(
                checked.embedding_model, checked.api_base, egress_policy(self.settings)
            )
        if checked.rerank_api_base and checked.rerank_api_base != kb.rerank_api_base:
            await egress_policy(self.settings).check_url(
                checked.rerank_api_base, field="rerank_api_base", what="call the rerank model at"
            )
        old, updated = await self._change(p.org_id, kb.kb_id, apply)
        if set(updated.tag_ids) != set(old.tag_ids):
            await self.bus.publish(
                Subject.KB_CHANGED,
                KbChanged(org_id=p.org_id, kb_id=kb.kb_id, change="tags", old_tag_ids=old.tag_ids),
            )
        if updated.settings_version != old.settings_version:
            await self.bus.publish(
                Subject.KB_CHANGED, KbChanged(org_id=p.org_id, kb_id=kb.kb_id, change="settings")
            )
        return await self.view(updated)

    async def _change(
        self, org_id: str, kb_id: str, apply: Callable[[KnowledgeBase], KnowledgeBase]
    ) -> tuple[KnowledgeBase, KnowledgeBase]:
        """Compare-and-set a KB definition: `apply(current) -> updated` runs again on the
        newest version when another request changed the KB meanwhile, so concurrent updates
        each count (every settings change gets its own settings version)."""
        key = f"{org_id}.{kb_id}"
        for _ in range(KB_CAS_ATTEMPTS):
            found = await self.reg.kbs.get_versioned(key)
            if found is None:
                raise NotFound(f"knowledge base {kb_id!r} not found", field="kb_id")
            current, last = found
            updated = apply(current.model_copy(deep=True))
            try:
                await self.reg.kbs.update(key, updated, last)
            except Conflict:
                continue
            return current, updated
        raise Transient("the knowledge base is being changed concurrently; try again")

    async def delete(self, p: Principal, ref: str) -> Ack:
        kb = await self.resolve(p, ref, write=True)
        await self.reg.kbs.delete(f"{p.org_id}.{kb.kb_id}")
        collections = [kb.collection_for(g) for g in range(1, kb.index_generation + 1)]
        await self.bus.publish(
            Subject.KB_CHANGED,
            KbChanged(org_id=p.org_id, kb_id=kb.kb_id, change="deleted", collections=collections),
        )
        return Ack(status="deleted", kb_id=kb.kb_id)

    async def reindex(self, p: Principal, ref: str, *, failed_only: bool = False) -> Ack:
        kb = await self.resolve(p, ref, write=True)
        if not failed_only:

            def bump(current: KnowledgeBase) -> KnowledgeBase:
                current.settings_version += 1
                current.status = KBStatus.pending_reindex
                current.updated_at = utcnow()
                return current

            _, kb = await self._change(p.org_id, kb.kb_id, bump)
        await self.bus.publish(
            Subject.KB_CHANGED,
            KbChanged(
                org_id=p.org_id, kb_id=kb.kb_id, change="retry_failed" if failed_only else "reindex"
            ),
        )
        members = [d for d in await self.reg.documents.list(f"{p.org_id}.") if kb.matches(d.tags)]
        return Ack(status="reindexing", kb_id=kb.kb_id, documents=len(members))

    async def stats(self, p: Principal, ref: str) -> KbStats:
        kb = await self.resolve(p, ref)
        entries, members = await self._state(kb)
        failed = [d for d in members if d.status == DocStatus.failed or kb.kb_id in d.kb_errors]
        current = {e.document_id for e in entries if e.settings_version == kb.settings_version}
        pending = [
            d
            for d in members
            if d.status == DocStatus.ready
            and d.document_id not in current
            and kb.kb_id not in d.kb_errors
        ]
        return KbStats(
            kb_id=kb.kb_id,
            document_count=len(entries),
            chunk_count=sum(e.chunk_count for e in entries),
            total_documents_with_tags=len(members),
            failed_count=len(failed),
            pending_count=len(pending),
        )

    async def documents(
        self,
        p: Principal,
        ref: str,
        skip: int = 0,
        limit: int = 50,
        name_search: str | None = None,
    ) -> Page[KbDocumentView]:
        kb = await self.resolve(p, ref)
        entries, members = await self._state(kb)
        by_doc = {e.document_id: e for e in entries}
        if name_search:
            members = [d for d in members if name_search.lower() in d.name.lower()]
        members.sort(key=lambda d: d.created_at)
        items = [
            KbDocumentView(
                document_id=d.document_id,
                name=d.name,
                source_id=d.source_id,
                status=_kb_doc_status(d, by_doc.get(d.document_id), kb),
                chunk_count=by_doc[d.document_id].chunk_count if d.document_id in by_doc else 0,
                indexed_at=by_doc[d.document_id].indexed_at if d.document_id in by_doc else None,
                revision=d.revision,
            )
            for d in members[skip : skip + limit]
        ]
        return Page[KbDocumentView](items=items, total=len(members), skip=skip, limit=limit)

    async def view(self, kb: KnowledgeBase) -> KbView:
        entries, members = await self._state(kb)
        status = kb.status
        behind = [e for e in entries if e.settings_version != kb.settings_version]
        ready = [d for d in members if d.status == DocStatus.ready]
        # The stored status only records that a reindex was asked for; what is left to do
        # is read from the index entries.
        if status == KBStatus.pending_reindex and not behind:
            status = KBStatus.active
        if status == KBStatus.active and len(entries) < len(ready):
            status = KBStatus.indexing
        return KbView(
            **kb.model_dump(exclude={"org_id", "status"}),
            status=status,
            document_count=len(entries),
            chunk_count=sum(e.chunk_count for e in entries),
        )

    async def _state(self, kb: KnowledgeBase) -> tuple[list[IndexEntry], list[DocumentRecord]]:
        entries, documents = await asyncio.gather(
            self.reg.index.list(f"{kb.kb_id}."), self.reg.documents.list(f"{kb.org_id}.")
        )
        return entries, [d for d in documents if kb.matches(d.tags)]


def validate_kb(kb: KnowledgeBase) -> None:
    """Cross-field KB rules (single-field ranges are on the request model)."""
    if kb.embedding_model.startswith("local/") and kb.embedding_model != ("local/all-MiniLM-L6-v2"):
        raise InvalidInput(
            f"embedding_model {kb.embedding_model!r}: the only bundled local model is "
            "local/all-MiniLM-L6-v2; use a LiteLLM model id for others",
            field="embedding_model",
        )
    limit = model_limits(kb.embedding_model)
    if limit is not None and kb.chunk_size > limit:
        raise InvalidInput(
            f"chunk_size {kb.chunk_size} exceeds the input limit of {kb.embedding_model} "
            f"({limit} tokens)",
            field="chunk_size",
        )
    if not 50 <= kb.chunk_size <= 2000:
        raise InvalidInput("chunk_size must be between 50 and 2000 tokens", field="chunk_size")
    if not 0 <= kb.chunk_overlap < kb.chunk_size:
        raise InvalidInput(
            f"chunk_overlap must be >= 0 and smaller than chunk_size ({kb.chunk_size})",
            field="chunk_overlap",
        )
    if not 0 <= kb.coalesce_neighbors <= 5:
        raise InvalidInput("coalesce_neighbors must be between 0 and 5", field="coalesce_neighbors")
    for tag in kb.tag_ids:
        if not tag or tag.startswith(COLLECTION_PREFIX):
            raise InvalidInput(f"tag_ids: invalid tag {tag!r}", field="tag_ids")


def _kb_doc_status(record: DocumentRecord, entry: IndexEntry | None, kb: KnowledgeBase) -> str:
    if record.status != DocStatus.ready:
        return record.status.value
    if kb.kb_id in record.kb_errors:
        return "failed"
    if entry is None or entry.revision < record.revision:
        return "processing"
    return "complete" if entry.settings_version == kb.settings_version else "pending_reindex"
