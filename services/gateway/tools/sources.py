"""The `core` tools over sources: git repositories and web sites that kbmesh keeps a knowledge
base in sync with — list, read, add, change, sync now and remove — thin over
`GatewayService.sources`, as REST is."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.auth import Principal
from services.gateway.schemas import SourceAck, SourceCreate, SourceList, SourceUpdate, SourceView
from services.gateway.service import GatewayService
from services.gateway.tools.registry import tool

# Errors about a source or the KB it feeds name the parameters these tools take.
SOURCE_FIELDS = {"source_id": "source", "kb_id": "kb"}


class SourceListInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kb: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="only the sources feeding this knowledge base (name or id); omitted: all "
        "you can access",
    )


class KbSourceRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        min_length=1,
        max_length=200,
        description="the source's id, or its name (see kb_source_list)",
    )


class SourceUpdateInput(SourceUpdate, KbSourceRef):
    pass


class SourceRemoveInput(KbSourceRef):
    keep_documents: bool = Field(
        False, description="keep the documents it brought in (default: they are deleted too)"
    )


@tool("core", title="List sources", read_only=True, error_fields=SOURCE_FIELDS)
async def kb_source_list(service: GatewayService, p: Principal, inp: SourceListInput) -> SourceList:
    """List the git repositories and web sites kept in sync with knowledge bases: each with
    its kind, url, schedule, whether it is enabled, and its status — the last run (added,
    changed, unchanged, deleted and failed counts, error), the next scheduled run, and a
    short run history. Use it to see whether a knowledge base is up to date."""
    return await service.sources.page(p, inp.kb)


@tool("core", title="Show a source", read_only=True, error_fields=SOURCE_FIELDS)
async def kb_source_get(service: GatewayService, p: Principal, inp: KbSourceRef) -> SourceView:
    """One source's definition and status, with its recent runs and their errors."""
    return await service.sources.get(p, inp.source)


@tool("core", title="Add a source", error_fields=SOURCE_FIELDS, open_world=True)
async def kb_source_add(service: GatewayService, p: Principal, inp: SourceCreate) -> SourceView:
    """Keep a knowledge base in sync with a git repository (kind git: url of the remote,
    branch, include/exclude path globs such as docs/**) or a documentation site (kind web:
    start url, sitemap, max_pages, rate). It syncs on its schedule (an interval such as 1h,
    or a cron expression) and at once after kb_source_sync; only what changed is read and
    embedded. The answer's webhook_secret is shown only this once."""
    return await service.sources.create(p, inp)


@tool("core", title="Change a source", destructive=True, error_fields=SOURCE_FIELDS)
async def kb_source_update(
    service: GatewayService, p: Principal, inp: SourceUpdateInput
) -> SourceView:
    """Change a source: only the fields you pass (schedule, enabled, include, exclude,
    branch, ...). Set enabled to false to pause its schedule."""
    changes = SourceUpdate.model_validate(inp.model_dump(exclude_unset=True, exclude={"source"}))
    return await service.sources.update(p, inp.source, changes)


@tool("core", title="Sync a source now", error_fields=SOURCE_FIELDS)
async def kb_source_sync(service: GatewayService, p: Principal, inp: KbSourceRef) -> SourceAck:
    """Sync a source now instead of waiting for its schedule (after the run under way, if
    one is). Runs in the background: watch kb_source_get for its status."""
    return await service.sources.sync(p, inp.source)


@tool("core", title="Remove a source", destructive=True, error_fields=SOURCE_FIELDS)
async def kb_source_remove(
    service: GatewayService, p: Principal, inp: SourceRemoveInput
) -> SourceAck:
    """Stop syncing a source and forget it: its definition, state and credentials, and —
    unless keep_documents — every document it brought into the knowledge base."""
    return await service.sources.delete(p, inp.source, keep_documents=inp.keep_documents)
