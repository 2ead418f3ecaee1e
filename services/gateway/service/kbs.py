"""Knowledge bases: their definitions (written here: the gateway owns the KB API, and
announces every change with `kb.changed`), resolution by id or name, and their views."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from services.common.bus.audit import AuditAction, AuditEntry
from services.common.bus.audit import sink as audit_sink
from services.common.bus.client import Bus
from services.common.bus.registry import Registries
from services.common.domain.errors import Conflict, InvalidInput, NotFound
from services.common.domain.ids import new_kb_id
from services.common.domain.limits import TAG_LENGTH, TAGS_PER_DOCUMENT, URI_LENGTH
from services.common.domain.models import (
    BUNDLED_MODELS,
    CHUNK_SIZE_RANGE,
    DEFAULT_KB,
    KB_TAG_PREFIX,
    MAX_NEIGHBORS,
    DocStatus,
    IndexEntry,
    KBStatus,
    KnowledgeBase,
    split_tags,
    utcnow,
)
from services.common.embedders import model_limits
from services.common.messages.events import KbChanged
from services.common.messages.names import Subject
from services.common.messages.queries import TOP_K_MAX
from services.common.outbound.egress import egress_policy
from services.common.outbound.modelcalls import check_destination
from services.common.settings import Settings
from services.gateway.auth import Principal
from services.gateway.catalog import Catalog, DocumentSummary, EntrySummary
from services.gateway.modelcheck import check_model
from services.gateway.progress import kb_progress
from services.gateway.schemas import (
    Ack,
    DefaultsView,
    KbCreate,
    KbDefaults,
    KbDocumentView,
    KbList,
    KbProgress,
    KbStats,
    KbUpdate,
    KbView,
    LimitsView,
    ModelDefaults,
    Page,
)
from services.gateway.service.access import check_kb_tags_in_scope, kb_rank

# Derives other orgs' default KB ids (see `KnowledgeBases.default_id`).
DEFAULT_KB_NAMESPACE = uuid.UUID("0b3f6c52-2d7e-4f0a-9a43-5c1e8d7b6a29")
REINDEX_FIELDS = ("chunker", "chunk_size", "chunk_overlap", "embedding_model", "api_base")
# Index entries a cancel writes back at once: enough to overlap their round trips to NATS,
# few enough not to queue ahead of other requests for long.
RESTORES_AT_ONCE = 32


class KnowledgeBases:
    def __init__(
        self, bus: Bus, registries: Registries, settings: Settings, catalog: Catalog
    ) -> None:
        self.bus = bus
        self.reg = registries
        self.settings = settings
        self.catalog = catalog
        self._locks: dict[str, asyncio.Lock] = {}
        self._audit_sink = audit_sink(lambda: bus.js)

    def default_id(self, org_id: str) -> str:
        """The id of an org's default KB. KB ids must be unique across orgs: collections,
        index entries and point ids are keyed by KB id alone, so a default KB shared by id
        would let one org overwrite, count or drop another's vectors. The configured
        default org keeps the plain name as id; every other org gets one derived from it."""
        if org_id == self.settings.default_org:
            return DEFAULT_KB
        return uuid.uuid5(DEFAULT_KB_NAMESPACE, f"{org_id}/{DEFAULT_KB}").hex

    async def ensure_default(self, org_id: str) -> KnowledgeBase:
        key = self.reg.kbs.key(org_id, self.default_id(org_id))
        kb = await self.reg.kbs.get(key)
        if kb is not None:
            return kb
        kb = KnowledgeBase(
            org_id=org_id,
            kb_id=self.default_id(org_id),
            name=DEFAULT_KB,
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
        # Reads resolve from the live mirror (as names already do); writes from the bucket.
        kb = await self.reg.kbs.resolve(p.org_id, ref, fresh=write)
        if kb is None and ref == DEFAULT_KB and p.kb_ids is None:
            if p.read_only:  # a read must not create anything
                raise NotFound(f"knowledge base {ref!r} not found", field="kb_id")
            kb = await self.ensure_default(p.org_id)
        if kb is None or not p.can_see(kb.kb_id):
            raise NotFound(f"knowledge base {ref!r} not found", field="kb_id")
        p.check_kb(kb.kb_id, write=write)
        return kb

    async def _check_reranker(self, kb: KnowledgeBase) -> None:
        """The reranker's address (its api_base, or its provider's default) must be one the
        egress policy allows, checked at save like the embedding model's."""
        if kb.rerank_model:
            await check_destination(
                egress_policy(self.settings),
                kb.rerank_model,
                kb.rerank_api_base,
                model_field="rerank_model",
                what="call the rerank model at",
            )
        elif kb.rerank_api_base:
            await egress_policy(self.settings).check_url(
                kb.rerank_api_base, field="rerank_api_base", what="call the rerank model at"
            )

    async def create(self, p: Principal, body: KbCreate) -> KbView:
        p.check_org_wide_write()
        fields = body.model_dump(exclude_none=True)
        fields.setdefault("embedding_model", self.settings.default_model)
        self._check_count(await self.reg.kbs.of_org(p.org_id), body.name)
        # Off the loop: the first remote model lookup imports litellm (seconds).
        kb = await asyncio.to_thread(
            lambda: checked_kb(
                {"org_id": p.org_id, "kb_id": new_kb_id(), **with_model_defaults(fields)}
            )
        )
        await check_model(kb.embedding_model, kb.api_base, egress_policy(self.settings))
        await self._check_reranker(kb)
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
        await self._audit(p, kb, "created")
        return await self.view(kb)

    async def defaults(self) -> DefaultsView:
        """The settings a KB gets when a client names none, per embedding model, and the
        limits a client must respect: one source for the console, the CLI and the docs."""
        # Off the loop: a remote default model's lookup imports litellm.
        return await asyncio.to_thread(defaults_view, self.settings)

    async def _audit(self, p: Principal, kb: KnowledgeBase, action: AuditAction) -> None:
        await self._audit_sink(
            AuditEntry(
                org_id=p.org_id,
                kind="kb",
                action=action,
                writer=p.writer,
                kb_id=kb.kb_id,
                name=kb.name,
            )
        )

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
        kbs = [k for k in await self.reg.kbs.of_org(p.org_id) if p.can_see(k.kb_id)]
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
            others = await self.reg.kbs.of_org(p.org_id)
            if any(k.name == changes["name"] for k in others):
                raise Conflict(f"a knowledge base named {changes['name']!r} exists", field="name")
        nullable = ("api_base", "rerank_model", "rerank_api_base")
        update = {k: v for k, v in changes.items() if v is not None or k in nullable}
        added = sorted(set(update.get("tag_ids", kb.tag_ids)) - set(kb.tag_ids))
        check_kb_tags_in_scope(p, kb.kb_id, added)
        indexed = await self._indexed(kb.kb_id)

        def apply(current: KnowledgeBase) -> KnowledgeBase:
            updated = checked_kb({**current.model_dump(), **update})
            if any(getattr(updated, f) != getattr(current, f) for f in REINDEX_FIELDS):
                updated.settings_version = current.settings_version + 1
                updated.status = KBStatus.pending_reindex
                if indexed:
                    # Built into a new collection: the current one keeps answering searches,
                    # with its own model and chunks, until embed has built the new one (or
                    # the rebuild is cancelled).
                    updated.rebuild_from(current)
                elif (updated.embedding_model, updated.api_base) != (
                    current.embedding_model,
                    current.api_base,
                ):
                    # Other vectors (maybe another dimension) need another collection.
                    updated.generations = max(current.generations, current.index_generation) + 1
                    updated.index_generation = updated.generations
            updated.updated_at = utcnow()
            return updated

        # Off the loop: the first remote model lookup imports litellm (seconds).
        checked = await asyncio.to_thread(apply, kb)
        if (checked.embedding_model, checked.api_base) != (kb.embedding_model, kb.api_base):
            await check_model(
                checked.embedding_model, checked.api_base, egress_policy(self.settings)
            )
        if (checked.rerank_model, checked.rerank_api_base) != (kb.rerank_model, kb.rerank_api_base):
            await self._check_reranker(checked)
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
        await self._audit(p, updated, "changed")
        return await self.view(updated)

    async def _change(
        self, org_id: str, kb_id: str, apply: Callable[[KnowledgeBase], KnowledgeBase]
    ) -> tuple[KnowledgeBase, KnowledgeBase]:
        """Compare-and-set a KB definition: concurrent updates each count (every settings
        change gets its own settings version)."""
        changed = await self.reg.kbs.change(self.reg.kbs.key(org_id, kb_id), apply)
        if changed is None:
            raise NotFound(f"knowledge base {kb_id!r} not found", field="kb_id")
        return changed

    async def delete(self, p: Principal, ref: str) -> Ack:
        """Delete the KB. Refused while sources feed it: they would go on sending documents
        to a KB that no longer exists; the caller removes them, or moves them elsewhere."""
        kb = await self.resolve(p, ref, write=True)
        feeding = [s for s in await self.reg.sources.of_org(p.org_id) if s.kb_id == kb.kb_id]
        if feeding:
            named = ", ".join(sorted(s.source_id for s in feeding))
            raise Conflict(
                f"knowledge base {ref!r} is fed by {len(feeding)} source(s) ({named}): "
                "remove them, or move them to another KB, before deleting it",
                field="kb_id",
            )
        await self.reg.kbs.delete(self.reg.kbs.key(p.org_id, kb.kb_id))
        last = max(kb.generations, kb.index_generation)
        collections = [kb.collection_for(g) for g in range(1, last + 1)]
        await self.bus.publish(
            Subject.KB_CHANGED,
            KbChanged(org_id=p.org_id, kb_id=kb.kb_id, change="deleted", collections=collections),
        )
        await self._audit(p, kb, "deleted")
        return Ack(status="deleted", kb_id=kb.kb_id)

    async def reindex(self, p: Principal, ref: str, *, failed_only: bool = False) -> Ack:
        kb = await self.resolve(p, ref, write=True)
        if not failed_only:
            indexed = await self._indexed(kb.kb_id)

            def bump(current: KnowledgeBase) -> KnowledgeBase:
                updated = current.model_copy(deep=True)
                updated.settings_version += 1
                updated.status = KBStatus.pending_reindex
                updated.updated_at = utcnow()
                if indexed:
                    updated.rebuild_from(current)
                return updated

            _, kb = await self._change(p.org_id, kb.kb_id, bump)
        await self.bus.publish(
            Subject.KB_CHANGED,
            KbChanged(
                org_id=p.org_id, kb_id=kb.kb_id, change="retry_failed" if failed_only else "reindex"
            ),
        )
        members = self.catalog.figures(kb).members
        return Ack(status="reindexing", kb_id=kb.kb_id, documents=members)

    async def _indexed(self, kb_id: str) -> bool:
        """Whether the KB has index entries (then a settings change builds a new collection
        while the current one serves): decided on the bucket as it stands now."""
        await self.catalog.settled()
        return self.catalog.indexed(kb_id) > 0

    async def cancel_reindex(self, p: Principal, ref: str) -> Ack:
        """Abandon the rebuild in progress: searches keep reading the collection they read,
        the half-built one is dropped, and the KB's settings return to that collection's."""
        kb = await self.resolve(p, ref, write=True)
        abandoned: list[str] = []

        def cancel(current: KnowledgeBase) -> KnowledgeBase:
            abandoned.clear()
            if current.serving is None:
                raise Conflict(f"knowledge base {ref!r} has no reindex running", field="kb_id")
            abandoned.extend([*current.abandoned_collections, current.collection_name])
            current.cancel_rebuild()
            current.updated_at = utcnow()
            return current

        _, kb = await self._change(p.org_id, kb.kb_id, cancel)
        await self._restore_entries(kb)
        await self.bus.publish(
            Subject.KB_CHANGED,
            KbChanged(org_id=p.org_id, kb_id=kb.kb_id, change="cancelled", collections=abandoned),
        )
        return Ack(status="cancelled", kb_id=kb.kb_id)

    async def _restore_entries(self, kb: KnowledgeBase) -> None:
        """Back to the index entries of the collection searches read, which every entry the
        rebuild wrote kept: the KB's counts are that collection's when the cancel answers.
        Embed indexes what cannot come back this way (a text changed during the rebuild)."""

        async def restore(entry: IndexEntry) -> None:
            if entry.for_build(kb) is not entry:  # compare-and-set: embed may write it too
                await self.reg.index.change(entry.key, lambda current: current.for_build(kb))

        entries = await self.reg.index.list(f"{kb.kb_id}.", fresh=True)
        for start in range(0, len(entries), RESTORES_AT_ONCE):
            await asyncio.gather(*map(restore, entries[start : start + RESTORES_AT_ONCE]))

    async def progress(self, kb: KnowledgeBase) -> KbProgress:
        return kb_progress(kb, self.catalog.figures(kb))

    async def stats(self, p: Principal, ref: str) -> KbStats:
        kb = await self.resolve(p, ref)
        figures = self.catalog.figures(kb)
        return KbStats(
            kb_id=kb.kb_id,
            document_count=figures.entries,
            chunk_count=figures.chunks,
            total_documents_with_tags=figures.members,
            failed_count=figures.failed,
            pending_count=figures.pending,
            progress=kb_progress(kb, figures),
        )

    async def documents(
        self,
        p: Principal,
        ref: str,
        skip: int = 0,
        limit: int = 50,
        name_search: str | None = None,
        status: str | None = None,
    ) -> Page[KbDocumentView]:
        kb = await self.resolve(p, ref)
        members = self.catalog.members(kb)
        if name_search:
            members = [d for d in members if name_search.lower() in d.name.lower()]
        if status is not None:
            members = [
                d
                for d in members
                if _kb_doc_status(d, self.catalog.entry(kb.kb_id, d.document_id), kb) == status
            ]
        members.sort(key=lambda d: d.created_at)
        # Views only for the page: a KB of 100k documents pages through them in memory.
        views = [
            _kb_document_view(d, self.catalog.entry(kb.kb_id, d.document_id), kb)
            for d in members[skip : skip + limit]
        ]
        return Page[KbDocumentView](items=views, total=len(members), skip=skip, limit=limit)

    async def view(self, kb: KnowledgeBase) -> KbView:
        figures = self.catalog.figures(kb)
        status = kb.status
        # The stored status only records that a reindex was asked for; what is left to do
        # is read from the index entries, and a rebuild lasts until searches read its
        # collection (`serving` cleared), a moment after its last entry is written.
        if (
            status == KBStatus.pending_reindex
            and figures.current == figures.entries
            and kb.serving is None
        ):
            status = KBStatus.active
        if status == KBStatus.active and figures.entries < figures.ready:
            status = KBStatus.indexing
        return KbView(
            **kb.model_dump(exclude={"org_id", "status"}),
            status=status,
            document_count=figures.entries,
            chunk_count=figures.chunks,
        )


def default_chunk_size(model: str) -> int:
    """The KB default chunk size, cut to what `model` takes in one input."""
    return min(int(KnowledgeBase.model_fields["chunk_size"].default), model_limits(model))


def with_model_defaults(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` of a new KB with the chunk size its model takes when none is given, so a
    KB created with defaults alone works with any model."""
    if "chunk_size" in fields:
        return fields
    try:
        size = default_chunk_size(fields["embedding_model"])
    except InvalidInput:
        return fields  # an unknown model: `checked_kb` refuses it, naming the field
    return {**fields, "chunk_size": size}


def defaults_view(settings: Settings) -> DefaultsView:
    fields = KnowledgeBase.model_fields
    model = settings.default_model
    return DefaultsView(
        kb=KbDefaults(
            chunker=fields["chunker"].default,
            chunk_size=default_chunk_size(model),
            chunk_overlap=fields["chunk_overlap"].default,
            embedding_model=model,
            coalesce_neighbors=fields["coalesce_neighbors"].default,
        ),
        models=[
            ModelDefaults(
                embedding_model=m, max_chunk_size=model_limits(m), chunk_size=default_chunk_size(m)
            )
            for m in dict.fromkeys((model, *BUNDLED_MODELS))
        ],
        limits=LimitsView(
            chunk_size_min=CHUNK_SIZE_RANGE[0],
            chunk_size_max=CHUNK_SIZE_RANGE[1],
            coalesce_neighbors_max=MAX_NEIGHBORS,
            top_k_max=TOP_K_MAX,
            knowledge_bases_per_org=settings.kb_limit,
            tags_per_document=TAGS_PER_DOCUMENT,
            tag_length=TAG_LENGTH,
            metadata_bytes=settings.limits.metadata_bytes,
            uri_length=URI_LENGTH,
            text_bytes=settings.max_content_bytes,
        ),
    )


def checked_kb(fields: dict[str, Any]) -> KnowledgeBase:
    """A KB definition from `fields`, held to the model's rules (a changed copy skips them)
    and to its embedding model's input limit; InvalidInput names the field at fault."""
    try:
        kb = KnowledgeBase.model_validate(fields)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        field = str(first["loc"][0]) if first["loc"] else None
        message = str(first["msg"]).removeprefix("Value error, ")
        raise InvalidInput(message, field=field) from err
    limit = model_limits(kb.embedding_model)
    if limit is not None and kb.chunk_size > limit:
        raise InvalidInput(
            f"chunk_size {kb.chunk_size} exceeds the input limit of {kb.embedding_model} "
            f"({limit} tokens)",
            field="chunk_size",
        )
    return kb


def _kb_document_view(
    d: DocumentSummary, entry: EntrySummary | None, kb: KnowledgeBase
) -> KbDocumentView:
    tags, collection = split_tags(d.tags)
    status = _kb_doc_status(d, entry, kb)
    return KbDocumentView(
        document_id=d.document_id,
        name=d.name,
        source_id=d.source_id,
        uri=d.uri,
        status=status,
        error=((d.kb_errors or {}).get(kb.kb_id) or d.error) if status == "failed" else None,
        tags=[t for t in tags if not t.startswith(KB_TAG_PREFIX)],
        collection=collection,
        chunk_count=entry.chunk_count if entry else 0,
        indexed_at=entry.indexed_at if entry else None,
        revision=d.revision,
    )


def _kb_doc_status(record: DocumentSummary, entry: EntrySummary | None, kb: KnowledgeBase) -> str:
    if record.status != DocStatus.ready:
        return record.status.value
    if kb.kb_id in (record.kb_errors or {}):
        return "failed"
    if entry is None or entry.revision < record.revision:
        return "processing"
    return "complete" if entry.built_for(kb) else "pending_reindex"
