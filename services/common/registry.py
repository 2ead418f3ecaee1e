"""Registries on JetStream KV (`kbs`, `documents`, `index`, `keys`, `prompts`) and the `texts`
object store. Values are pydantic records stored as JSON; writes that race use compare-and-set."""

from __future__ import annotations

import asyncio
from typing import Any, Generic, TypeVar

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from pydantic import BaseModel

from services.common.answers import Prompt
from services.common.errors import Conflict
from services.common.models import DocumentRecord, IndexEntry, KnowledgeBase

M = TypeVar("M", bound=BaseModel)


class Registry(Generic[M]):
    def __init__(self, kv: KeyValue, model: type[M]) -> None:
        self.kv = kv
        self.model = model
        self._mirror: dict[str, M] | None = None
        self._mirror_task: asyncio.Task[None] | None = None

    async def mirror(self) -> None:
        """Keep a live in-memory copy of the bucket (for small buckets read on every
        request, like `kbs`): `list` then costs nothing and opens no consumer."""
        if self._mirror is not None:
            return
        watcher = await self.kv.watch(">", inactive_threshold=60.0)
        self._mirror = await self._read_initial(watcher, ">")

        async def follow() -> None:
            assert self._mirror is not None
            async for entry in watcher:
                if entry is None:
                    continue
                self._apply(self._mirror, entry)

        self._mirror_task = asyncio.create_task(follow())

    async def close(self) -> None:
        if self._mirror_task is not None:
            self._mirror_task.cancel()
            self._mirror_task = None

    async def get(self, key: str) -> M | None:
        found = await self.get_versioned(key)
        return found[0] if found else None

    async def lookup(self, key: str) -> M | None:
        """`get` answered from the mirror when the key is in it (no round trip; a change made
        elsewhere shows once the watch delivers it, within milliseconds), else from the bucket.
        For reads on a request's hot path; decisions that write use `get_versioned`."""
        if self._mirror is not None:
            found = self._mirror.get(key)
            if found is not None:
                return found
        return await self.get(key)

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
        self._remember(key, value)
        return revision

    def _remember(self, key: str, value: M | None) -> None:
        """Our own writes show in our mirror at once (read-your-writes in-process)."""
        if self._mirror is not None:
            if value is None:
                self._mirror.pop(key, None)
            else:
                self._mirror[key] = value

    async def create(self, key: str, value: M) -> int:
        try:
            revision = await self.kv.create(key, value.model_dump_json().encode())
        except KeyWrongLastSequenceError as err:
            raise Conflict(f"{key} already exists") from err
        self._remember(key, value)
        return revision

    async def update(self, key: str, value: M, last: int) -> int:
        """Write only if nobody wrote since revision `last` (raises Conflict otherwise)."""
        try:
            revision = await self.kv.update(key, value.model_dump_json().encode(), last=last)
        except KeyWrongLastSequenceError as err:
            raise Conflict(f"{key} changed concurrently") from err
        self._remember(key, value)
        return revision

    async def delete(self, key: str) -> None:
        try:
            await self.kv.purge(key)
        except (KeyNotFoundError, NotFoundError):
            return
        finally:
            self._remember(key, None)

    async def list(self, prefix: str = "") -> list[M]:
        """Every value under `prefix` (a key prefix ending in '.')."""
        if self._mirror is not None:
            return [v for k, v in list(self._mirror.items()) if k.startswith(prefix)]
        pattern = f"{prefix}>" if prefix else ">"
        # Each watch is an ephemeral consumer on the server: let it expire quickly.
        watcher = await self.kv.watch(pattern, inactive_threshold=5.0)
        try:
            return list((await self._read_initial(watcher, pattern)).values())
        finally:
            await watcher.stop()

    async def _read_initial(self, watcher: Any, pattern: str) -> dict[str, M]:
        """Read the current values from a fresh watch.

        nats-py's "no more values" marker can fire before values already on the wire are
        handled, so the marker is only trusted once the stream confirms there is nothing
        under the pattern; otherwise we read until the consumer reports nothing pending.
        Deletes are watched too, so that the last message always ends the read."""
        found: dict[str, M] = {}
        while True:
            entry = await watcher.updates(timeout=10.0)
            if entry is None:
                if await self._empty(pattern):
                    return found
                continue
            self._apply(found, entry)
            if entry.delta == 0:
                return found

    def _apply(self, values: dict[str, M], entry: Any) -> None:
        if entry.operation is None and entry.value:
            values[entry.key] = self.model.model_validate_json(entry.value)
        else:
            values.pop(entry.key, None)

    async def _empty(self, pattern: str) -> bool:
        info = await self.kv._js.stream_info(
            self.kv._stream, subjects_filter=f"$KV.{self.kv._name}.{pattern}"
        )
        return not info.state.subjects


class TextStore:
    """Extracted text and original bytes, in the `texts` object store."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    async def put(self, name: str, data: bytes) -> None:
        await self.store.put(name, data)

    async def get(self, name: str) -> bytes | None:
        try:
            result = await self.store.get(name)
        except (NotFoundError, KeyNotFoundError):
            return None
        return result.data or b""

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


class Registries:
    def __init__(
        self,
        kbs: Registry[KnowledgeBase],
        documents: Registry[DocumentRecord],
        index: Registry[IndexEntry],
        keys: Registry[ApiKey],
        texts: TextStore,
        prompts: Registry[Prompt],
    ) -> None:
        self.kbs = kbs
        self.documents = documents
        self.index = index
        self.keys = keys
        self.texts = texts
        self.prompts = prompts

    @classmethod
    async def open(cls, js: JetStreamContext) -> Registries:
        kbs, documents, index, keys, prompts = await asyncio.gather(
            js.key_value("kbs"),
            js.key_value("documents"),
            js.key_value("index"),
            js.key_value("keys"),
            js.key_value("prompts"),
        )
        texts = await js.object_store("texts")
        registries = cls(
            Registry(kbs, KnowledgeBase),
            Registry(documents, DocumentRecord),
            Registry(index, IndexEntry),
            Registry(keys, ApiKey),
            TextStore(texts),
            Registry(prompts, Prompt),
        )
        await registries.kbs.mirror()
        return registries

    async def close(self) -> None:
        for registry in (self.kbs, self.documents, self.index, self.keys, self.prompts):
            await registry.close()
