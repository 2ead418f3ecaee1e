"""The sources service's logic: runs of sources, one replica at a time, and their schedule.

A run (`SourcesService.run`) takes the source's lease by compare-and-set, reads the source's
definition, secrets and state, asks the fetcher of its kind for the changes since the state's
cursor, and publishes each change as an upstream system would: `doc.uploaded` (content inline
when it is text, else staged in the object store; never base64 on the bus) or `doc.deleted`.
Each event's id derives from the source, the uri, the revision, the cursor the run started
from and the placement (KB, tags, collection) it sends with, so a run done again (its
replica died halfway) publishes the same events: JetStream drops the repeats within its
window and ingest recognises them after it. Only when every publish is acknowledged does
the state move to the fetcher's new cursor; a run that fails keeps the cursor (and every
document), records why, and is done again at its next turn.
The state also keeps the placement the documents were sent with: a source moved to another
KB, or given other tags or another collection, sends every document again at its next run.

The lease (`SourceLease`) is renewed while the run works; a run that loses it (its replica
stalled past the expiry and another took over) stops before its next publish and writes
nothing. The scheduler (`due`, `tick`) starts runs whose time has come or that were asked for
(`state.requested`, set by `request` on a `source.sync` or by the gateway).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import logging
import socket
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta

from services.common.bus.registry import Registries, SourceRegistry
from services.common.domain.content import content_checksum, staging_name
from services.common.domain.errors import Raced
from services.common.domain.formats import by_name
from services.common.domain.models import DocStatus, Writer, utcnow
from services.common.domain.sources import (
    RunTrigger,
    Source,
    SourceLease,
    SourcePlacement,
    SourceRun,
    SourceState,
    document_id_for,
    next_run,
)
from services.common.messages.events import (
    DocDeleted,
    DocUploaded,
    Event,
    SourceRunEvent,
)
from services.common.messages.names import Subject
from services.sources.fetch import Done, Failed, Fetcher, Gone, Put, SourceError, Unchanged

log = logging.getLogger("kbmesh.sources")

# How long a lease holds without renewal: a replica that died is taken over after this long.
# Renewed every third of it while the run works.
LEASE_SECONDS = 20.0
# A `source.run` progress event every this many documents (plus one at the start and the end).
PROGRESS_EVERY = 50
# Text up to this size travels inline in `doc.uploaded` (as the gateway sends it); bytes and
# larger text are staged in the object store.
INLINE_BYTES = 256 * 1024
# Runs one replica works on at once.
MAX_RUNS = 4
# The scheduler looks for due sources this often (a sync asked for wakes it at once).
TICK_SECONDS = 5.0

Publish = Callable[[str, Event], Awaitable[None]]


class LeaseLost(Exception):
    """Another replica took the source over: this run stops and writes nothing."""


def event_id(*parts: str) -> str:
    """An event id derived from what the event says, so a run done again sends the same."""
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return f"src-{digest[:40]}"


def encode_cursor(state: bytes | None) -> str | None:
    """A fetcher's state as the state record keeps it: text as it is (a commit id, JSON);
    other bytes in base64, marked."""
    if state is None:
        return None
    try:
        text = state.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(state).decode()
    return text if not text.startswith("base64:") else "base64:" + base64.b64encode(state).decode()


def decode_cursor(cursor: str | None) -> bytes | None:
    if cursor is None:
        return None
    if cursor.startswith("base64:"):
        return base64.b64decode(cursor.removeprefix("base64:"))
    return cursor.encode("utf-8")


def due(
    source: Source,
    state: SourceState | None,
    now: datetime,
    lease: SourceLease | None = None,
) -> RunTrigger | None:
    """Whether `source` should run now, and as what: a sync asked for runs even when the
    source is disabled (a person asked), and so does a run that never ended (its lease is
    still there: its replica died, or still works and keeps it); otherwise an enabled
    source runs when it never ran, or when its next run's time has come."""
    if state is not None and state.requested is not None:
        return state.requested
    if lease is not None:
        return "schedule"
    if not source.enabled:
        return None
    if state is None or state.next_run_at is None or state.next_run_at <= now:
        return "schedule"
    return None


def lease_free(lease: SourceLease | None, now: datetime) -> bool:
    """A lease may be taken when there is none, or when its holder let it expire."""
    return lease is None or lease.expires_at <= now


class SourcesService:
    def __init__(
        self,
        registries: Registries,
        publish: Publish,
        fetchers: Mapping[str, Fetcher],
        *,
        holder: str | None = None,
        lease_seconds: float = LEASE_SECONDS,
        progress_every: int = PROGRESS_EVERY,
        max_runs: int = MAX_RUNS,
    ) -> None:
        self.reg = registries
        self.sources: SourceRegistry = registries.sources
        self.publish = publish
        self.fetchers = dict(fetchers)
        # Who holds a lease: this replica (host and a per-process id).
        self.holder = holder or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.lease_seconds = lease_seconds
        self.progress_every = progress_every
        self.slots = asyncio.Semaphore(max_runs)
        self.running: dict[str, asyncio.Task[SourceRun | None]] = {}
        self.wake = asyncio.Event()

    # ---- asking for runs -------------------------------------------------------------------

    async def request(self, org_id: str, source_id: str, trigger: RunTrigger) -> bool:
        """Ask for a run of the source as soon as a replica is free to do it (a run under way
        is followed by another). False when there is no such source."""
        if await self.sources.get(org_id, source_id) is None:
            log.warning("sync_unknown_source org_id=%s source_id=%s", org_id, source_id)
            return False
        key = SourceRegistry.state_key(org_id, source_id)

        def ask(state: SourceState) -> SourceState:
            state.requested = trigger
            return state

        if await self.sources.states.change(key, ask) is None:
            fresh = SourceState(org_id=org_id, source_id=source_id, requested=trigger)
            try:
                await self.sources.states.create(key, fresh)
            except Raced:  # a run created it meanwhile: ask on what it wrote
                await self.sources.states.change(key, ask)
        self.wake.set()
        return True

    # ---- the scheduler ---------------------------------------------------------------------

    async def tick(self) -> list[asyncio.Task[SourceRun | None]]:
        """Start a run of every source that is due and not running here; the tasks started."""
        now = utcnow()
        started = []
        for source in await self.sources.all():
            if source.key in self.running:
                continue
            state = await self.sources.state(source.org_id, source.source_id)
            lease = await self.sources.leases.get(
                SourceRegistry.lease_key(source.org_id, source.source_id)
            )
            trigger = due(source, state, now, lease)
            if trigger is None:
                continue
            task = asyncio.create_task(self._slot(source.org_id, source.source_id, trigger))
            self.running[source.key] = task
            task.add_done_callback(functools.partial(self._ended, source.key))
            started.append(task)
        return started

    async def schedule(self, tick_seconds: float = TICK_SECONDS) -> None:
        """Run due sources for as long as the process runs."""
        while True:
            try:
                await self.tick()
            except Exception:  # the bus away, a bad record: the next tick tries again
                log.exception("scheduler_tick_failed")
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), tick_seconds)

    async def close(self) -> None:
        for task in list(self.running.values()):
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)

    def _ended(self, key: str, task: asyncio.Task[SourceRun | None]) -> None:
        self.running.pop(key, None)

    async def _slot(self, org_id: str, source_id: str, trigger: RunTrigger) -> SourceRun | None:
        async with self.slots:
            try:
                return await self.run(org_id, source_id, trigger)
            except LeaseLost:
                return None  # the replica that took it over finishes it
            except Exception:
                log.exception("source_run_crashed org_id=%s source_id=%s", org_id, source_id)
                return None

    # ---- a run -----------------------------------------------------------------------------

    async def run(self, org_id: str, source_id: str, trigger: RunTrigger) -> SourceRun | None:
        """Run the source now if no replica does: its finished `SourceRun`, or None when
        another replica holds it (or it no longer exists)."""
        source = await self.sources.get(org_id, source_id)
        if source is None:
            return None
        run = SourceRun(run_id=uuid.uuid4().hex, trigger=trigger)
        lease_key = SourceRegistry.lease_key(org_id, source_id)
        revision = await self._take_lease(lease_key, run.run_id)
        if revision is None:
            return None
        lost = asyncio.Event()
        renewing = asyncio.create_task(self._renew(lease_key, run.run_id, revision, lost))
        try:
            return await self._run(source, run, lost)
        finally:
            renewing.cancel()
            last = await asyncio.gather(renewing, return_exceptions=True)
            held = last[0]
            if isinstance(held, int) and held > 0:
                with contextlib.suppress(Raced, Exception):
                    await self.sources.leases.delete_unchanged(lease_key, held)

    async def _take_lease(self, key: str, run_id: str) -> int | None:
        lease = SourceLease(
            holder=self.holder,
            run_id=run_id,
            expires_at=utcnow() + timedelta(seconds=self.lease_seconds),
        )
        found = await self.sources.leases.get_versioned(key)
        try:
            if found is None:
                return await self.sources.leases.create(key, lease)
            current, last = found
            if not lease_free(current, utcnow()):
                return None
            return await self.sources.leases.update(key, lease, last)
        except Raced:
            return None  # another replica took it a moment ago

    async def _renew(self, key: str, run_id: str, revision: int, lost: asyncio.Event) -> int:
        """Renew the lease every third of its life until cancelled; the revision it holds.
        A failed renewal (another replica took it) sets `lost`."""
        try:
            while True:
                await asyncio.sleep(self.lease_seconds / 3)
                lease = SourceLease(
                    holder=self.holder,
                    run_id=run_id,
                    expires_at=utcnow() + timedelta(seconds=self.lease_seconds),
                )
                try:
                    revision = await self.sources.leases.update(key, lease, revision)
                except Raced:
                    lost.set()
                    return -1
                except Exception as err:  # the bus away: try again at the next renewal
                    log.warning("lease_not_renewed key=%s error=%r", key, err)
        except asyncio.CancelledError:
            return revision

    async def _run(self, source: Source, run: SourceRun, lost: asyncio.Event) -> SourceRun:
        state_key = SourceRegistry.state_key(source.org_id, source.source_id)
        state = await self._started(source, state_key)
        await self._announce(source, run)
        log.info(
            "source_run_started org_id=%s source_id=%s run_id=%s trigger=%s",
            source.org_id,
            source.source_id,
            run.run_id,
            run.trigger,
        )
        done: Done | None = None
        try:
            fetcher = self.fetchers.get(source.kind)
            if fetcher is None:
                raise SourceError(f"this kbmesh cannot read {source.kind} sources")
            if await self.reg.kbs.get(self.reg.kbs.key(source.org_id, source.kb_id)) is None:
                raise SourceError(f"the KB it feeds ({source.kb_id}) no longer exists")
            secrets = await self.reg.source_secrets.find(source.org_id, source.source_id)
            placement = SourcePlacement.of(source)
            # Its KB, tags or collection changed since its documents were sent: every
            # document again (from no cursor: the whole listing), whatever its bytes.
            replace = state.placement is not None and state.placement != placement
            cursor = None if replace else decode_cursor(state.cursor)
            base = f"{state.cursor or ''}@{placement.digest()}"
            seen: set[str] = set()
            sent = 0
            async for change in fetcher.fetch(source, secrets, cursor):
                if lost.is_set():
                    raise LeaseLost("another replica took this source over")
                if isinstance(change, Done):
                    done = change
                    break
                seen.add(change.uri)
                if isinstance(change, Put):
                    await self._put(source, run, change, base, force=replace)
                elif isinstance(change, Gone):
                    await self._gone(source, run, change.uri, base)
                elif isinstance(change, Unchanged):
                    run.unchanged += 1
                elif isinstance(change, Failed):
                    run.failed += 1
                    log.warning(
                        "source_document_failed source_id=%s uri=%s error=%s",
                        source.source_id,
                        change.uri,
                        change.error,
                    )
                sent += 1
                if sent % self.progress_every == 0:
                    await self._announce(source, run)
            if done is None:
                raise SourceError("the fetcher ended without saying where the run ended")
            if done.complete:
                await self._sweep(source, run, seen, base)
            if lost.is_set():
                raise LeaseLost("another replica took this source over")
            run.revision = done.revision
            run.requests, run.bytes_read = done.requests, done.bytes_read
            run.status = "succeeded"
        except LeaseLost:
            log.warning("source_run_abandoned source_id=%s run_id=%s", source.source_id, run.run_id)
            raise
        except asyncio.CancelledError:
            raise
        except Exception as err:
            run.status = "failed"
            run.error = (str(err) or repr(err))[:2000]
            log.warning(
                "source_run_failed org_id=%s source_id=%s error=%s",
                source.org_id,
                source.source_id,
                run.error,
            )
        run.finished_at = utcnow()
        await self._finished(source, state_key, run, done if run.status == "succeeded" else None)
        await self._announce(source, run)
        log.info(
            "source_run_finished org_id=%s source_id=%s run_id=%s status=%s added=%d "
            "changed=%d unchanged=%d deleted=%d failed=%d",
            source.org_id,
            source.source_id,
            run.run_id,
            run.status,
            run.added,
            run.changed,
            run.unchanged,
            run.deleted,
            run.failed,
        )
        return run

    async def _started(self, source: Source, key: str) -> SourceState:
        """The state a run starts from, with the request it answers taken and the source due
        again at once (so that, should this replica die, the next one runs it)."""
        now = utcnow()

        def start(state: SourceState) -> SourceState:
            state.requested = None
            state.next_run_at = now
            return state

        changed = await self.sources.states.change(key, start)
        if changed is not None:
            return changed[1]
        fresh = SourceState(org_id=source.org_id, source_id=source.source_id, next_run_at=now)
        try:
            await self.sources.states.create(key, fresh)
        except Raced:  # a request arrived meanwhile
            changed = await self.sources.states.change(key, start)
            if changed is not None:
                return changed[1]
        return fresh

    async def _finished(self, source: Source, key: str, run: SourceRun, done: Done | None) -> None:
        """The run in the history; with `done`, the cursor moved to where it ended. A sync
        asked for meanwhile stays asked for."""

        def finish(state: SourceState) -> SourceState:
            if done is not None:
                state.cursor = encode_cursor(done.state)
                state.placement = SourcePlacement.of(source)
            state.finished(run)
            state.next_run_at = next_run(source.schedule, run.started_at)
            return state

        await self.sources.states.change(key, finish)

    async def _announce(self, source: Source, run: SourceRun) -> None:
        await self.publish(
            Subject.SOURCE_RUN,
            SourceRunEvent(
                org_id=source.org_id,
                source_id=source.source_id,
                kb_id=source.kb_id,
                run=run.model_copy(),
            ),
        )

    async def _put(
        self, source: Source, run: SourceRun, put: Put, base: str, *, force: bool = False
    ) -> None:
        document_id = document_id_for(source.source_id, put.uri)
        existing = await self.reg.documents.find(source.org_id, document_id)
        if (
            not force
            and existing is not None
            and existing.status != DocStatus.failed
            and existing.content_checksum == content_checksum(put.content)
            and existing.name == put.name
        ):
            run.unchanged += 1  # the same bytes: nothing to read again, nothing to embed
            return
        event = DocUploaded(
            event_id=event_id(source.source_id, put.uri, put.revision, base),
            org_id=source.org_id,
            document_id=document_id,
            name=put.name,
            mime_type=_mime_type(put),
            source_id=source.source_id,
            uri=put.uri,
            source_revision=put.revision,
            tags=source.tags,
            collection=source.collection,
            metadata=put.metadata,
            kb_id=source.kb_id,
            writer=Writer(kind="source", name=source.source_id),
        )
        text = _text(put.content)
        if text is not None and len(put.content) <= INLINE_BYTES:
            event.content = text
        else:
            event.object_ref = staging_name(source.org_id, event.event_id)
            await self.reg.texts.put(event.object_ref, put.content)
        await self.publish(Subject.DOC_UPLOADED, event)
        if existing is None:
            run.added += 1
        else:
            run.changed += 1

    async def _gone(
        self, source: Source, run: SourceRun, uri: str, base: str, document_id: str | None = None
    ) -> None:
        document_id = document_id or document_id_for(source.source_id, uri)
        await self.publish(
            Subject.DOC_DELETED,
            DocDeleted(
                event_id=event_id("gone", source.source_id, document_id, base),
                org_id=source.org_id,
                document_ids=[document_id],
                writer=Writer(kind="source", name=source.source_id),
            ),
        )
        run.deleted += 1

    async def _sweep(self, source: Source, run: SourceRun, seen: set[str], base: str) -> None:
        """After a complete listing: the source's documents it did not name are gone."""
        for record in await self.reg.documents.of_org(source.org_id):
            if record.source_id == source.source_id and record.uri not in seen:
                await self._gone(source, run, record.uri or "", base, record.document_id)


def _text(data: bytes) -> str | None:
    """`data` as text when it is UTF-8 without NUL characters (what travels inline)."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _mime_type(put: Put) -> str:
    """The type the fetcher read (a web page's Content-Type), else the one the file's name
    says, else left to ingest to read from the bytes."""
    if put.mime_type:
        return put.mime_type
    known = by_name(put.name)
    if known is not None and known.kind != "image":
        return known.mime_type
    return "text/plain" if _text(put.content) is not None else "application/octet-stream"
