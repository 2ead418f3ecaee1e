"""Registries on JetStream KV (`kbs`, `documents`, `index`, `keys`) and the `texts` object
store. Values are pydantic records stored as JSON; writes that race use compare-and-set."""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from pydantic import BaseModel

from services.common.errors import Conflict
from services.common.models import DocumentRecord, IndexEntry, KnowledgeBase

M = TypeVar("M", bound=BaseModel)


class Registry(Generic[M]):
    def __init__(self, kv: KeyValue, model: type[M]) -> None:
        self.kv = kv
        self.model = model

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
        return await self.kv.put(key, value.model_dump_json().encode())

    async def create(self, key: str, value: M) -> int:
        try:
            return await self.kv.create(key, value.model_dump_json().encode())
        except KeyWrongLastSequenceError as err:
            raise Conflict(f"{key} already exists") from err

    async def update(self, key: str, value: M, last: int) -> int:
        """Write only if nobody wrote since revision `last` (raises Conflict otherwise)."""
        try:
            return await self.kv.update(key, value.model_dump_json().encode(), last=last)
        except KeyWrongLastSequenceError as err:
            raise Conflict(f"{key} changed concurrently") from err

    async def delete(self, key: str) -> None:
        try:
            await self.kv.purge(key)
        except (KeyNotFoundError, NotFoundError):
            return

    async def list(self, prefix: str = "") -> list[M]:
        """Every value under `prefix` (a key prefix ending in '.'), read in one watch.

        nats-py's "no more values" marker can fire before values already on the wire are
        handled, so the marker is only trusted once the stream confirms there is nothing
        under the prefix; otherwise we read until the consumer reports nothing pending.
        Deletes are watched too, so that the last message always ends the read."""
        pattern = f"{prefix}>" if prefix else ">"
        watcher = await self.kv.watch(pattern)
        found: dict[str, M] = {}
        try:
            while True:
                entry = await watcher.updates(timeout=10.0)
                if entry is None:
                    if await self._empty(pattern):
                        break
                    continue
                if entry.operation is None and entry.value:
                    found[entry.key] = self.model.model_validate_json(entry.value)
                else:
                    found.pop(entry.key, None)
                if entry.delta == 0:
                    break
        finally:
            await watcher.stop()
        return list(found.values())

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
    ) -> None:
        self.kbs = kbs
        self.documents = documents
        self.index = index
        self.keys = keys
        self.texts = texts

    @classmethod
    async def open(cls, js: JetStreamContext) -> Registries:
        kbs, documents, index, keys = await asyncio.gather(
            js.key_value("kbs"), js.key_value("documents"), js.key_value("index"),
            js.key_value("keys"),
        )
        texts = await js.object_store("texts")
        return cls(
            Registry(kbs, KnowledgeBase),
            Registry(documents, DocumentRecord),
            Registry(index, IndexEntry),
            Registry(keys, ApiKey),
            TextStore(texts),
        )
