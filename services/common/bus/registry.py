"""Registries on JetStream KV (`kbs`, `documents`, `index`, `keys`, `prompts`, `sources`,
`source-secrets`) and the `texts` object store. Values are pydantic records stored as JSON;
writes that race use compare-and-set (`compare_and_set`, `Registry.change`), and a caller
that needs a value to reach a state waits on a watch of its key (`Registry.wait_for`), never
by polling.

Keys are built in one place per registry (`kbs.key(org, kb)`, `documents.key(org, doc)`,
`index.key(kb, doc)`), next to the lookups the domain needs (`kbs.resolve(org, ref)`).

Plain nats-py on the bus's connection: FastStream's `key_value()` / `object_storage()` would
hand back these same objects, and the buckets are declared once, by `declare_topology`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, BinaryIO, Generic, Protocol, TypeVar

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_DIGEST_TEMPLATE, ObjectStore
from pydantic import BaseModel, ValidationError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt

from services.common.domain.errors import Conflict, Raced, Transient
from services.common.domain.ids import is_id, uuid_forms
from services.common.domain.models import DocumentRecord, IndexEntry, KnowledgeBase
from services.common.domain.sources import Source, SourceLease, SourceSecrets, SourceState
from services.common.messages.answers import Prompt
from services.common.messages.names import SOURCE_SECRETS_BUCKET, SOURCES_BUCKET

log = logging.getLogger("kbmesh.registry")
M = TypeVar("M", bound=BaseModel)
M_contra = TypeVar("M_contra", bound=BaseModel, contravariant=True)
T = TypeVar("T")
CAS_ATTEMPTS = 20
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed compare-and-set


_WATCH_RECHECK_SECONDS = 1.0
# How long a decision that needs the server's truth waits for a live view to catch up with
# its bucket (`Registry.settled`); a watch delivers in milliseconds unless the gateway is
# swamped, and then the view answers as it stands.
SETTLE_SECONDS = 5.0
# How long the server keeps a short-lived watch's consumer (a wait's, a whole-bucket read's)
# once nobody listens on it. While the watch runs its subscription keeps the consumer alive
# whatever this is; after it ends the consumer is garbage, and kept for the whole wait timeout
# a burst of `wait=true` uploads piled up a thousand of them and NATS refused new ones
# ("maximum consumers limit reached").
_WATCH_INACTIVE_SECONDS = 5.0


async def compare_and_set(
    step: Callable[[], Awaitable[T]],
    *,
    what: str,
    attempts: int = CAS_ATTEMPTS,
    exhausted: type[Conflict] | type[Transient] = Transient,
) -> T:
    """Optimistic concurrency, the one way kbmesh changes what others change at the same
    time: `step` reads, decides and writes with compare-and-set (`Registry.update`, `create`
    or `delete_unchanged`; or reads and checks what it read), raising `Raced` when another
    writer got in between; it then runs again on what is there now, at once (the winner has
    already written). `attempts` lost races in a row are `exhausted`: by default
    `Transient`, so a consumer is redelivered later with the bus's backoff; a client's own
    change passes `Conflict` (409: its change met others, it decides again). Any other error
    of `step` is raised as it is."""
    retrying = AsyncRetrying(
        retry=retry_if_exception_type(Raced), stop=stop_after_attempt(attempts), reraise=True
    )
    try:
        return await retrying(step)
    except Raced as err:
        raise exhausted(f"{what} keeps changing concurrently; try again") from err


class Follower(Protocol[M_contra]):
    """A live view of a bucket that `Registry.follow` feeds: every value the bucket holds,
    then every change, as the watch delivers it (`revision`: the stream sequence), and the
    registry's own writes at once (`revision` of a put; None for a delete, whose sequence
    nats-py does not report). A view that keeps revisions can tell a late delivery of an
    older value from a newer one; one that does not simply takes the last."""

    def put(self, key: str, value: M_contra, revision: int | None) -> None: ...

    def drop(self, key: str, revision: int | None) -> None: ...


class _Copy(Generic[M]):
    """The plain live copy of a bucket (`Registry.mirror`)."""

    def __init__(self) -> None:
        self.values: dict[str, M] = {}

    def put(self, key: str, value: M, revision: int | None) -> None:
        self.values[key] = value

    def drop(self, key: str, revision: int | None) -> None:
        self.values.pop(key, None)


class _Following(Generic[M]):
    """One follower's watch: where it has got to in the bucket's stream, and who waits for
    it to get further (`Registry.settled`)."""

    def __init__(self, follower: Follower[M]) -> None:
        self.follower = follower
        self.sequence = 0
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []
        self.task: asyncio.Task[None] | None = None

    def reached(self, sequence: int) -> None:
        self.sequence = max(self.sequence, sequence)
        if self._waiting:
            done = [(s, f) for s, f in self._waiting if s <= self.sequence]
            for s, future in done:
                self._waiting.remove((s, future))
                if not future.done():
                    future.set_result(None)

    async def reach(self, sequence: int) -> None:
        if self.sequence >= sequence:
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((sequence, future))
        try:
            await future
        finally:
            if (sequence, future) in self._waiting:
                self._waiting.remove((sequence, future))


class Registry(Generic[M]):
    def __init__(self, kv: KeyValue, model: type[M]) -> None:
        self.kv = kv
        self.model = model
        self._mirror: dict[str, M] | None = None
        self._following: list[_Following[M]] = []

    async def mirror(self) -> None:
        """Keep a live in-memory copy of the bucket (for small buckets read on every
        request, like `kbs`): `list` then costs nothing and opens no consumer."""
        if self._mirror is not None:
            return
        copy: _Copy[M] = _Copy()
        await self.follow(copy)
        self._mirror = copy.values

    async def follow(self, follower: Follower[M]) -> None:
        """Feed `follower` every value of the bucket, then every change, for as long as the
        registry is open: one watch, read to the end before this returns."""
        following = _Following(follower)
        watcher = await self.kv.watch(">", inactive_threshold=60.0)

        def apply(entry: Any) -> None:
            value = None
            if entry.operation is None and entry.value:
                try:
                    value = self.model.model_validate_json(entry.value)
                except ValidationError as err:
                    # One value that does not parse must not stop the view: it reads as
                    # absent (as it does to `get`'s callers, who get the error).
                    log.warning(
                        "registry_value_unreadable bucket=%s key=%s error=%s",
                        self.kv._name,
                        entry.key,
                        str(err)[:300],
                    )
            if value is not None:
                follower.put(entry.key, value, entry.revision)
            else:
                follower.drop(entry.key, entry.revision)
            following.reached(entry.revision)

        try:
            await replay(self.kv, watcher, ">", apply)
        except BaseException:
            # A start retries this while JetStream fails over: leave no watch behind.
            await watcher.stop()
            raise

        async def follow() -> None:
            try:
                async for entry in watcher:
                    if entry is not None:
                        apply(entry)
            finally:  # closed (also when a start's later step failed and is tried again)
                with contextlib.suppress(Exception):
                    await watcher.stop()

        following.task = asyncio.create_task(follow())
        self._following.append(following)

    async def settled(self, timeout: float = SETTLE_SECONDS) -> bool:
        """Wait until every follower has what the bucket holds now: one request for the
        stream's last sequence, then the watch's delivery up to it. For decisions that need
        the server's truth (a write deciding on what exists); False when the watch lags
        beyond `timeout`, and the followers then answer with what they have."""
        if not self._following:
            return True
        state = (await self.kv._js.stream_info(self.kv._stream)).state
        if state.messages == 0:
            return True
        try:
            async with asyncio.timeout(timeout):
                for following in self._following:
                    await following.reach(state.last_seq)
        except TimeoutError:
            return False
        return True

    @property
    def mirrored(self) -> bool:
        """A live copy is kept (`mirror`): `list` answers from memory."""
        return self._mirror is not None

    async def close(self) -> None:
        for following in self._following:
            if following.task is not None:
                following.task.cancel()
        self._following = []

    async def get(self, key: str) -> M | None:
        found = await self.get_versioned(key)
        return found[0] if found else None

    async def get_versioned(self, key: str) -> tuple[M, int] | None:
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return None
        if entry.value is None or entry.revision is None:
            return None
        return self.model.model_validate_json(entry.value), entry.revision

    async def put(self, key: str, value: M) -> int:
        revision = await self.kv.put(key, value.model_dump_json().encode())
        self._remember(key, value, revision)
        return revision

    def _remember(self, key: str, value: M | None, revision: int | None = None) -> None:
        """Our own writes show in our followers at once (read-your-writes in-process)."""
        for following in self._following:
            if value is None:
                following.follower.drop(key, None)
            else:
                following.follower.put(key, value, revision)

    async def create(self, key: str, value: M) -> int:
        try:
            revision = await self.kv.create(key, value.model_dump_json().encode())
        except KeyWrongLastSequenceError as err:
            raise Raced(f"{key} already exists") from err
        self._remember(key, value, revision)
        return revision

    async def update(self, key: str, value: M, last: int) -> int:
        """Write only if nobody wrote since revision `last` (raises Raced otherwise)."""
        try:
            revision = await self.kv.update(key, value.model_dump_json().encode(), last=last)
        except KeyWrongLastSequenceError as err:
            raise Raced(f"{key} changed concurrently") from err
        self._remember(key, value, revision)
        return revision

    async def delete_unchanged(self, key: str, last: int) -> None:
        """Delete only if nobody wrote since revision `last` (raises Raced otherwise)."""
        try:
            await self.kv.delete(key, last=last)
        except APIError as err:
            if err.err_code == WRONG_LAST_SEQUENCE:
                raise Raced(f"{key} changed concurrently") from err
            raise
        self._remember(key, None)

    async def change(
        self, key: str, apply: Callable[[M], M], *, attempts: int = CAS_ATTEMPTS
    ) -> tuple[M, M] | None:
        """Compare-and-set: `apply(current) -> updated` is written only if nobody wrote the
        key meanwhile, else it runs again on the newer value, so concurrent changes each
        count. Returns (old, new), or None when the key does not exist."""

        async def step() -> tuple[M, M] | None:
            found = await self.get_versioned(key)
            if found is None:
                return None
            current, last = found
            updated = apply(current.model_copy(deep=True))
            await self.update(key, updated, last)
            return current, updated

        return await compare_and_set(step, what=key, attempts=attempts)

    async def wait_for(
        self, key: str, predicate: Callable[[M | None], bool], timeout: float
    ) -> tuple[bool, M | None]:
        """Wait until the value at `key` (None: absent) satisfies `predicate`, on a watch of
        the key. Returns (True, value) then, or (False, last value seen) after `timeout`."""
        deadline = time.monotonic() + timeout
        watcher = await self.kv.watch(key, inactive_threshold=_WATCH_INACTIVE_SECONDS)
        current: M | None = None
        try:
            while (remaining := deadline - time.monotonic()) > 0:
                try:
                    # Bounded, because nats-py can lose a watch's set-up under load (its
                    # consumer creation times out inside a callback) and then never yields:
                    # a quiet second re-reads the key instead of waiting out the deadline.
                    entry = await watcher.updates(timeout=min(remaining, _WATCH_RECHECK_SECONDS))
                except (TimeoutError, nats.errors.TimeoutError):
                    if deadline - time.monotonic() <= 0:
                        break
                    entry = None
                if entry is None:
                    # "No values yet" may come before a value already on the wire: ask.
                    current = await self.get(key)
                elif entry.operation is None and entry.value:
                    current = self.model.model_validate_json(entry.value)
                else:
                    current = None
                if predicate(current):
                    return True, current
            return False, current
        finally:
            await watcher.stop()

    async def delete(self, key: str) -> None:
        try:
            await self.kv.purge(key)
        except (KeyNotFoundError, NotFoundError):
            return
        finally:
            self._remember(key, None)

    async def matching(self, pattern: str) -> list[M]:
        """Every value whose key matches the NATS subject `pattern` (`*` one token, `>` the
        rest), read from the server."""
        raw = await read_current(self.kv, pattern)
        return [self.model.model_validate_json(v) for v in raw.values()]

    async def list(self, prefix: str = "", *, fresh: bool = False) -> list[M]:
        """Every value under `prefix` (a key prefix ending in '.'); from the live mirror when
        there is one, unless `fresh`."""
        if self._mirror is not None and not fresh:
            return [v for k, v in list(self._mirror.items()) if k.startswith(prefix)]
        return await self.matching(f"{prefix}>" if prefix else ">")


async def read_current(kv: KeyValue, pattern: str) -> dict[str, bytes]:
    """The current value of every key matching `pattern`, through a short-lived watch (an
    ephemeral consumer on the server, left to expire quickly)."""
    found: dict[str, bytes] = {}

    def keep(entry: Any) -> None:
        if entry.operation is None and entry.value:
            found[entry.key] = entry.value
        else:
            found.pop(entry.key, None)

    watcher = await kv.watch(pattern, inactive_threshold=_WATCH_INACTIVE_SECONDS)
    try:
        await replay(kv, watcher, pattern, keep)
    finally:
        await watcher.stop()
    return found


async def replay(kv: KeyValue, watcher: Any, pattern: str, apply: Callable[[Any], None]) -> None:
    """Hand `apply` every entry of a fresh watch of `pattern` (one that includes deletes) up
    to the bucket's current state.

    nats-py's "no more values" marker can fire before values already on the wire are handled
    (`kv.keys()` then answers nothing at all), so the marker is only trusted once the stream
    confirms there is nothing under the pattern; otherwise the read goes on until the
    consumer reports nothing pending. Deletes are watched too, so that the last message
    always ends the read."""
    while True:
        # What has arrived already is taken as it is; a timer only guards a wait (a bucket
        # of 100k values otherwise spends a fifth of its read arming timers).
        queue = watcher._updates
        entry = queue.get_nowait() if queue.qsize() else await watcher.updates(timeout=10.0)
        if entry is None:
            info = await kv._js.stream_info(kv._stream, subjects_filter=f"$KV.{kv._name}.{pattern}")
            if not info.state.subjects:
                return
            continue
        apply(entry)
        if entry.delta == 0:
            return


# A chunk of an object that does not arrive within this long was purged by a replacement.
_CHUNK_SECONDS = 2.0
_READ_ATTEMPTS = 3


def _digest(data: bytes) -> str:
    sha = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    return OBJ_DIGEST_TEMPLATE.format(digest=sha)


class TextStore:
    """Extracted text and original bytes, in the `texts` object store."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    async def put(self, name: str, data: bytes | BinaryIO) -> None:
        """Store `data` under `name`: bytes, or a file read in chunks (never whole)."""
        # nats-py reads any file with `readinto` chunk by chunk, in a worker thread.
        await self.store.put(name, data)  # type: ignore[arg-type]

    async def get(self, name: str) -> bytes | None:
        """The object's bytes, or None when there is none. Objects are replaced in place
        (a document's text under one name): nats-py's own `get` waits forever for chunks
        that a replacement purged mid-read, so chunks are read here with a bound, and a
        read that stalls starts again on the current version."""

        async def read() -> bytes | None:
            try:
                info = await self.store.get_info(name)
            except (NotFoundError, KeyNotFoundError):
                return None
            if not info.size:
                return b""
            if info.chunks == 1:
                data = await self._only_chunk(info.nuid or "")
            else:
                data = await self._chunks(info.nuid or "")
            if data is None or _digest(data) != info.digest:
                raise Raced(f"object {name} was replaced while it was read")
            return data

        return await compare_and_set(read, what=f"object {name}", attempts=_READ_ATTEMPTS)

    def _chunk_subject(self, nuid: str) -> str:
        return OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.store._name, obj=nuid)

    async def _only_chunk(self, nuid: str) -> bytes | None:
        """An object of one chunk (a text up to 128 kB, most documents) read as the last
        message on its chunk subject: one request, where a consumer costs the server a
        consumer's creation and deletion and two advisories per read."""
        try:
            msg = await self.store._js.get_last_msg(self.store._stream, self._chunk_subject(nuid))
        except NotFoundError:
            return None  # purged by a replacement (or deleted) under us
        return msg.data or b""

    async def _chunks(self, nuid: str) -> bytes | None:
        # The stream named: no request to look it up by subject first.
        sub = await self.store._js.subscribe(
            self._chunk_subject(nuid), stream=self.store._stream, ordered_consumer=True
        )
        data = bytearray()
        try:
            while True:
                msg = await sub.next_msg(timeout=_CHUNK_SECONDS)
                data += msg.data
                if msg.metadata.num_pending == 0:
                    return bytes(data)
        except nats.errors.TimeoutError:
            return None  # purged by a replacement (or deleted) under us
        finally:
            await sub.unsubscribe()

    async def get_text(self, name: str) -> str | None:
        data = await self.get(name)
        return None if data is None else data.decode("utf-8")

    async def delete(self, name: str) -> None:
        try:
            await self.store.delete(name)
        except (NotFoundError, KeyNotFoundError):
            return


class ApiKey(BaseModel):
    """A stored API key: only its hash is kept."""

    key_hash: str
    org_id: str
    name: str = ""
    kb_ids: list[str] | None = None  # None: every KB of the org
    read_only: bool = False


class KbRegistry(Registry[KnowledgeBase]):
    """KB definitions, per org (`<org>.<kb>`)."""

    @staticmethod
    def key(org_id: str, kb_id: str) -> str:
        return f"{org_id}.{kb_id}"

    async def of_org(self, org_id: str) -> list[KnowledgeBase]:
        return await self.list(f"{org_id}.")

    async def resolve(self, org_id: str, ref: str, *, fresh: bool = False) -> KnowledgeBase | None:
        """A KB of the org by id — a UUID id in either spelling, dashed or 32 hex digits —
        else by name. Answered from the live mirror unless `fresh` (before a write)."""
        ids = [kb_id for kb_id in uuid_forms(ref) or (ref,) if is_id(kb_id)]
        mirror = None if fresh else self._mirror
        if mirror is not None:
            # What the mirror knows first, ids before names: a search by name must not pay
            # a bucket round trip for the id it is not.
            for kb_id in ids:
                if (kb := mirror.get(self.key(org_id, kb_id))) is not None:
                    return kb
            if (kb := _named(await self.of_org(org_id), ref)) is not None:
                return kb
        # Unknown to the mirror: perhaps created elsewhere a moment ago, not yet delivered.
        for kb_id in ids:
            if (kb := await self.get(self.key(org_id, kb_id))) is not None:
                return kb
        # Names come from the mirror either way (`of_org`): already looked at above.
        return None if mirror is not None else _named(await self.of_org(org_id), ref)


def _named(kbs: list[KnowledgeBase], name: str) -> KnowledgeBase | None:
    return next((kb for kb in kbs if kb.name == name), None)


class DocumentRegistry(Registry[DocumentRecord]):
    """Document records, per org (`<org>.<document>`)."""

    @staticmethod
    def key(org_id: str, document_id: str) -> str:
        return f"{org_id}.{document_id}"

    async def of_org(self, org_id: str) -> list[DocumentRecord]:
        return await self.list(f"{org_id}.")

    async def find(self, org_id: str, document_id: str) -> DocumentRecord | None:
        return await self.get(self.key(org_id, document_id)) if is_id(document_id) else None


class IndexRegistry(Registry[IndexEntry]):
    """Index entries, per KB (`<kb>.<document>`): what embed indexed, at which revision."""

    @staticmethod
    def key(kb_id: str, document_id: str) -> str:
        return f"{kb_id}.{document_id}"

    async def of_kb(self, kb_id: str) -> list[IndexEntry]:
        return await self.list(f"{kb_id}.")

    async def find(self, kb_id: str, document_id: str) -> IndexEntry | None:
        return await self.get(self.key(kb_id, document_id))


class SourceRegistry:
    """Sources, per org, in the `sources` bucket: the definition (`<org>.<source>`), its
    sync state (`<org>.<source>.state`, the sources service's) and the lease of the replica
    running it (`<org>.<source>.lease`). Three records of three models under one bucket, so
    three typed views of it; their keys are built here only."""

    def __init__(self, kv: KeyValue) -> None:
        self.definitions: Registry[Source] = Registry(kv, Source)
        self.states: Registry[SourceState] = Registry(kv, SourceState)
        self.leases: Registry[SourceLease] = Registry(kv, SourceLease)

    @staticmethod
    def key(org_id: str, source_id: str) -> str:
        return f"{org_id}.{source_id}"

    @classmethod
    def state_key(cls, org_id: str, source_id: str) -> str:
        return f"{cls.key(org_id, source_id)}.state"

    @classmethod
    def lease_key(cls, org_id: str, source_id: str) -> str:
        return f"{cls.key(org_id, source_id)}.lease"

    async def get(self, org_id: str, source_id: str) -> Source | None:
        return await self.definitions.get(self.key(org_id, source_id))

    async def state(self, org_id: str, source_id: str) -> SourceState | None:
        return await self.states.get(self.state_key(org_id, source_id))

    async def put(self, source: Source) -> int:
        return await self.definitions.put(self.key(source.org_id, source.source_id), source)

    async def all(self) -> list[Source]:
        """Every definition of every org (what the scheduler walks)."""
        return await self._definitions("*.*")

    async def of_org(self, org_id: str) -> list[Source]:
        return await self._definitions(f"{org_id}.*")

    async def with_id(self, source_id: str, orgs: Iterable[str]) -> list[Source]:
        """The source with this id in each of `orgs` (ids are chosen per org, so there may
        be several): one direct read per org, no consumer on the server, since anyone may
        call a webhook."""
        if not is_id(source_id):
            return []
        keys = [self.key(org, source_id) for org in sorted(set(orgs))]
        found = await asyncio.gather(*(self.definitions.get(k) for k in keys))
        return [s for s in found if s is not None]

    async def _definitions(self, pattern: str) -> list[Source]:
        # `<org>.<source>` is two tokens: the state and lease records under a source's key
        # (three) are not read at all.
        return await self.definitions.matching(pattern)

    async def remove(self, org_id: str, source_id: str) -> None:
        """Forget a source: its definition, state and lease (its documents are the caller's
        to delete: `doc.deleted` with its source_id)."""
        await self.definitions.delete(self.key(org_id, source_id))
        await self.states.delete(self.state_key(org_id, source_id))
        await self.leases.delete(self.lease_key(org_id, source_id))


class SourceSecretsRegistry(Registry[SourceSecrets]):
    """Sources' secrets (`<org>.<source>`), in a bucket only the gateway, the sources
    service and the operator may read (services/common/bus/auth.py)."""

    @staticmethod
    def key(org_id: str, source_id: str) -> str:
        return f"{org_id}.{source_id}"

    async def find(self, org_id: str, source_id: str) -> SourceSecrets | None:
        return await self.get(self.key(org_id, source_id))


class Registries:
    def __init__(
        self,
        kbs: KbRegistry,
        documents: DocumentRegistry,
        index: IndexRegistry,
        keys: Registry[ApiKey],
        texts: TextStore,
        prompts: Registry[Prompt],
        sources: SourceRegistry,
        source_secrets: SourceSecretsRegistry,
    ) -> None:
        self.kbs = kbs
        self.documents = documents
        self.index = index
        self.keys = keys
        self.texts = texts
        self.prompts = prompts
        self.sources = sources
        # Opened by every service (a bucket's handle reads nothing); read only by those
        # allowed to.
        self.source_secrets = source_secrets

    @classmethod
    async def open(cls, js: JetStreamContext) -> Registries:
        kbs, documents, index, keys, prompts, sources, secrets = await asyncio.gather(
            js.key_value("kbs"),
            js.key_value("documents"),
            js.key_value("index"),
            js.key_value("keys"),
            js.key_value("prompts"),
            js.key_value(SOURCES_BUCKET),
            js.key_value(SOURCE_SECRETS_BUCKET),
        )
        texts = await js.object_store("texts")
        registries = cls(
            KbRegistry(kbs, KnowledgeBase),
            DocumentRegistry(documents, DocumentRecord),
            IndexRegistry(index, IndexEntry),
            Registry(keys, ApiKey),
            TextStore(texts),
            Registry(prompts, Prompt),
            SourceRegistry(sources),
            SourceSecretsRegistry(secrets, SourceSecrets),
        )
        # Both read on every request: KBs to resolve names, keys to know whether any exist.
        try:
            await registries.kbs.mirror()
            await registries.keys.mirror()
        except BaseException:
            await registries.close()  # a start tries the whole again
            raise
        return registries

    async def close(self) -> None:
        for registry in (self.kbs, self.documents, self.index, self.keys, self.prompts):
            await registry.close()
