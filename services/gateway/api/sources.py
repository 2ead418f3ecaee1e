"""REST: sources (git repositories and web sites kept in sync with a KB), their "sync now",
and the webhook git hosts call on a push."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from services.gateway.api.deps import Caller
from services.gateway.api.deps import SourceDefs as SourcesDep
from services.gateway.api.routing import StrictBodyRoute
from services.gateway.schemas import SourceAck, SourceCreate, SourceList, SourceUpdate, SourceView

router = APIRouter(prefix="/v1/sources", tags=["sources"], route_class=StrictBodyRoute)
# The webhook reads its body raw (the signature is over its bytes) and takes no API key.
hook_router = APIRouter(prefix="/v1/sources", tags=["sources"])


@router.post("", status_code=201)
async def create_source(body: SourceCreate, sources: SourcesDep, caller: Caller) -> SourceView:
    """Add a source feeding a KB. The answer carries the webhook secret, once: configure it
    on the git host with `hook_path`. A git token or key given here is never shown again."""
    return await sources.create(caller, body)


@router.get("")
async def list_sources(
    sources: SourcesDep,
    caller: Caller,
    kb: Annotated[str | None, Query(description="only the sources feeding this KB")] = None,
) -> SourceList:
    """The sources you can see, with their last run, next run, counts and errors."""
    return await sources.page(caller, kb)


@router.get("/{source}")
async def get_source(source: str, sources: SourcesDep, caller: Caller) -> SourceView:
    """One source (by id, or by name when one has it) with its run history."""
    return await sources.get(caller, source)


@router.patch("/{source}")
async def update_source(
    source: str, body: SourceUpdate, sources: SourcesDep, caller: Caller
) -> SourceView:
    """Change a source: only the fields given. `rotate_webhook_secret` answers the new
    secret, once."""
    return await sources.update(caller, source, body)


@router.delete("/{source}")
async def delete_source(
    source: str,
    sources: SourcesDep,
    caller: Caller,
    keep_documents: Annotated[
        bool, Query(description="keep the documents it brought in (default: delete them)")
    ] = False,
) -> SourceAck:
    """Remove a source, its state and secrets, and (by default) its documents."""
    return await sources.delete(caller, source, keep_documents=keep_documents)


@router.post("/{source}/sync", status_code=202)
async def sync_source(source: str, sources: SourcesDep, caller: Caller) -> SourceAck:
    """Run the source now (after the run under way, if one is)."""
    return await sources.sync(caller, source)


@hook_router.post(
    "/{source}/hook",
    status_code=202,
    openapi_extra={
        "security": [],
        "requestBody": {
            "description": "the git host's push event, as it sent it",
            "content": {"application/json": {"schema": {"type": "object"}}},
        },
    },
)
async def source_hook(source: str, request: Request, sources: SourcesDep) -> SourceAck:
    """A git host's push event: no API key; signed with the source's webhook secret as
    `X-Hub-Signature-256: sha256=<HMAC-SHA256 of the body>` (GitHub, Gitea, Forgejo) or sent
    with it as `X-Gitlab-Token`. Verified, it starts a sync; refused calls answer 401 alike,
    whether or not the source exists, and are audited."""
    body = await request.body()
    caller = request.client.host if request.client else None
    return await sources.hook(source, body, request.headers, caller)
