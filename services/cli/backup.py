"""Backup and restore of a stack: `kbmesh backup FILE` and `kbmesh restore FILE --data-dir DIR`.

The archive holds the source of truth, read over the bus while the stack keeps serving:
KB definitions, API keys, stored prompts, and every document whose text is extracted, with
its text and original bytes. Each document is taken with the text its record describes (the
text's checksum is the record's; a document that changes while it is read is read again), so
the archive never pairs one revision's record with another's text.

Vectors are not in the archive: they are recomputed from the texts. `restore` builds a new
data dir, writes what the archive holds, and runs ingest and embed over it until every
document is indexed in every KB it belongs to, so `kbmesh up` on that dir answers as the
backed-up stack did. Documents still being extracted when the backup ran are left out and
listed in the archive's manifest: upload them again.

The archive is a gzip'd tar: `manifest.json`, `kv/<bucket>.jsonl` (key and value per line)
and `objects/<name>` (the `texts` object store).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import tarfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
from nats.js import JetStreamContext
from nats.js.errors import NoKeysError, NotFoundError

from services.cli.runtime import SERVICES, build_runtime, start_consuming
from services.common.bus import auth as busauth
from services.common.bus.registry import Registries, TextStore
from services.common.domain.content import checksum, content_checksum
from services.common.domain.layout import layout_object
from services.common.domain.models import DocStatus, DocumentRecord, KnowledgeBase
from services.common.messages.events import STREAM, KbChanged, Subject
from services.common.messages.names import KEYS_BUCKET
from services.common.ops.datadir import CURRENT_FORMAT, read_format
from services.common.settings import Settings

ARCHIVE_VERSION = 1
# The index bucket is left out: its entries describe vectors, which restore rebuilds.
BUCKETS = ("kbs", "keys", "prompts", "documents")
READS_PER_DOCUMENT = 5
# What ingest consumes from upstream and the gateway, with its durable consumers' names.
INGEST_CONSUMERS = (
    (Subject.DOC_UPLOADED, "ingest-doc-uploaded"),
    (Subject.OCR_DONE, "ingest-ocr-done"),
    (Subject.TAGS_CHANGED, "ingest-tags-changed"),
    (Subject.DOC_DELETED, "ingest-doc-deleted"),
)


class BackupError(Exception):
    """The archive cannot be written or restored; the message says why."""


@dataclass
class Manifest:
    archive_version: int = ARCHIVE_VERSION
    data_format: int = CURRENT_FORMAT
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    counts: dict[str, int] = field(default_factory=dict)
    # Documents not extracted yet when the backup ran: upload them again after a restore.
    skipped_documents: list[str] = field(default_factory=list)


def _original(record: DocumentRecord) -> str:
    return f"{record.org_id}/{record.document_id}/original"


async def _entries(js: JetStreamContext, bucket: str) -> dict[str, bytes]:
    kv = await js.key_value(bucket)
    try:
        keys = await kv.keys()
    except NoKeysError:
        return {}
    out: dict[str, bytes] = {}
    for key in keys:
        entry = await kv.get(key)
        if entry.value:
            out[key] = entry.value
    return out


async def _document(
    js: JetStreamContext, texts: TextStore, key: str, value: bytes
) -> tuple[bytes, dict[str, bytes]] | None:
    """The record at `key` with the objects of that same revision; None when it is not
    extracted yet (or gone). Read again while the text and the record disagree."""
    kv = await js.key_value("documents")
    for _ in range(READS_PER_DOCUMENT):
        record = DocumentRecord.model_validate_json(value)
        if record.status not in (DocStatus.ready, DocStatus.failed):
            return None
        objects: dict[str, bytes] = {}
        text = await texts.get(record.text_object)
        original = await texts.get(_original(record))
        # Headings and pages of the text, when its format has them
        # (services/common/domain/layout.py).
        layout = await texts.get(layout_object(record.org_id, record.document_id))
        consistent = True
        if record.status == DocStatus.ready:
            consistent = text is not None and checksum(text.decode("utf-8")) == record.checksum
        if original is not None and record.content_checksum is not None:
            consistent = consistent and content_checksum(original) == record.content_checksum
        if consistent:
            if text is not None:
                objects[record.text_object] = text
            if original is not None:
                objects[_original(record)] = original
            if layout is not None:
                objects[layout_object(record.org_id, record.document_id)] = layout
            return value, objects
        await asyncio.sleep(0.2)  # mid-change: its new revision is being written
        try:
            value = (await kv.get(key)).value or b""
        except Exception:  # deleted meanwhile
            return None
    raise BackupError(f"document {key} kept changing while it was read; run the backup again")


async def backup(js: JetStreamContext, path: Path) -> Manifest:
    """Write the archive of the stack behind `js` to `path` (replaced only when complete)."""
    texts = TextStore(await js.object_store("texts"))
    manifest = Manifest()
    # Events first, then the registries: an upload ingest finishes in between is then in
    # both (applied once on restore), never in neither.
    events = await _pending_events(js)
    buckets: dict[str, dict[str, bytes]] = {}
    objects: dict[str, bytes] = {}
    for bucket in BUCKETS:
        buckets[bucket] = await _entries(js, bucket)
    documents: dict[str, bytes] = {}
    for key, value in buckets["documents"].items():
        taken = await _document(js, texts, key, value)
        if taken is None:
            manifest.skipped_documents.append(key)
            continue
        documents[key], found = taken
        objects.update(found)
    buckets["documents"] = documents
    # Uploads accepted but not ingested yet: the bytes their events refer to.
    for name in await _object_names(texts) if events else []:
        if name not in objects and (data := await texts.get(name)) is not None:
            objects[name] = data
    manifest.counts = {bucket: len(entries) for bucket, entries in buckets.items()}
    manifest.counts["objects"] = len(objects)
    manifest.counts["pending_events"] = len(events)

    tmp = path.with_name(f".{path.name}.partial")
    with tarfile.open(tmp, "w:gz") as tar:
        _add(tar, "manifest.json", json.dumps(manifest.__dict__, indent=2).encode())
        for bucket, entries in buckets.items():
            lines = (json.dumps({"key": k, "value": v.decode("utf-8")}) for k, v in entries.items())
            _add(tar, f"kv/{bucket}.jsonl", "\n".join(lines).encode())
        for name, data in objects.items():
            _add(tar, f"objects/{name}", data)
        _add(tar, "events.jsonl", "\n".join(json.dumps(e) for e in events).encode())
    tmp.chmod(0o600)
    tmp.replace(path)
    return manifest


async def _object_names(texts: TextStore) -> list[str]:
    try:
        return [info.name for info in await texts.store.list(ignore_deletes=True)]
    except NotFoundError:  # nats-py's answer for an empty store
        return []


async def _pending_events(js: JetStreamContext) -> list[dict[str, Any]]:
    """Events ingest has not acknowledged yet (uploads accepted, not yet documents), oldest
    first. Some above a consumer's ack floor may be done already: ingest applies an event
    once, however often it arrives."""
    events: list[dict[str, Any]] = []
    for subject, durable in INGEST_CONSUMERS:
        try:
            info = await js.consumer_info(STREAM, durable)
        except NotFoundError:
            continue  # never consumed: everything on the subject is pending
            # (a stack that ran ingest always has the consumer)
        seq = info.ack_floor.stream_seq + 1 if info.ack_floor else 1
        while True:
            try:
                msg = await js.get_msg(STREAM, seq=seq, subject=subject, next=True)
            except NotFoundError:
                break
            events.append(
                {
                    "seq": msg.seq,
                    "subject": msg.subject,
                    "headers": dict(msg.headers or {}),
                    "data": base64.b64encode(msg.data or b"").decode(),
                }
            )
            seq = (msg.seq or seq) + 1
    return sorted(events, key=lambda e: e["seq"])


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    info.mode = 0o600
    tar.addfile(info, io.BytesIO(data))


@dataclass
class Archive:
    manifest: dict[str, Any]
    buckets: dict[str, dict[str, bytes]]
    objects: dict[str, bytes]
    events: list[dict[str, Any]]


def read_archive(path: Path) -> Archive:
    try:
        with tarfile.open(path, "r:gz") as tar:
            files = {
                m.name: f.read()
                for m in tar.getmembers()
                if m.isfile() and (f := tar.extractfile(m)) is not None
            }
    except (OSError, tarfile.TarError) as err:
        raise BackupError(f"{path} is not a kbmesh backup: {err}") from err
    if "manifest.json" not in files:
        raise BackupError(f"{path} is not a kbmesh backup: no manifest.json")
    manifest = json.loads(files["manifest.json"])
    if manifest.get("archive_version", 0) > ARCHIVE_VERSION:
        raise BackupError(
            f"{path} was written by a newer kbmesh (archive version "
            f"{manifest['archive_version']}); this one reads up to {ARCHIVE_VERSION}"
        )
    buckets: dict[str, dict[str, bytes]] = {}
    for bucket in BUCKETS:
        text = files.get(f"kv/{bucket}.jsonl", b"").decode("utf-8")
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        buckets[bucket] = {row["key"]: row["value"].encode("utf-8") for row in rows}
    objects = {
        name.removeprefix("objects/"): data
        for name, data in files.items()
        if name.startswith("objects/")
    }
    events = [
        json.loads(line)
        for line in files.get("events.jsonl", b"").decode("utf-8").splitlines()
        if line.strip()
    ]
    return Archive(manifest, buckets, objects, events)


async def restore(path: Path, data_dir: Path, *, timeout: float = 3600.0) -> Manifest:
    """A new data dir at `data_dir` holding what the archive at `path` holds, its vectors
    rebuilt: when this returns, `kbmesh up` on it serves the backed-up KBs and documents."""
    archive = read_archive(path)
    if read_format(data_dir) is not None:
        raise BackupError(f"{data_dir} is not empty: restore makes a new data dir")
    settings = Settings(data_dir=data_dir, nats_url=None)
    # Ingest and embed rebuild the index. The gateway is wired but never started (started,
    # it would add a default KB of its own beside the restored one).
    rt = await build_runtime(settings, SERVICES, embedded_nats=True)
    try:
        await start_consuming(rt)
        reg = rt.registries
        for name, data in archive.objects.items():
            await reg.texts.put(name, data)
        kbs: list[KnowledgeBase] = []
        for value in archive.buckets["kbs"].values():
            kb = KnowledgeBase.model_validate_json(value)
            # The collections a rebuild was reading from are not in the archive: the
            # restored KB serves the generation that restore builds.
            kb.cancel_rebuild()
            kbs.append(kb)
            await reg.kbs.put(f"{kb.org_id}.{kb.kb_id}", kb)
        await _restore_keys(rt.bus.url or "", data_dir, archive.buckets["keys"])
        for key, value in archive.buckets["prompts"].items():
            await reg.prompts.kv.put(key, value)
        for value in archive.buckets["documents"].values():
            record = DocumentRecord.model_validate_json(value)
            record.kb_ids, record.kb_errors = [], {}  # membership is decided again below
            await reg.documents.put(record.key, record)
        for kb in kbs:
            await rt.bus.publish(
                Subject.KB_CHANGED, KbChanged(org_id=kb.org_id, kb_id=kb.kb_id, change="created")
            )
        for event in archive.events:
            await rt.bus.js.publish(
                event["subject"],
                base64.b64decode(event["data"]),
                headers=event["headers"] or None,
                stream=STREAM,
            )
        await _indexed(rt.bus.js, reg, timeout)
    finally:
        await rt.close()
    return Manifest(**{k: v for k, v in archive.manifest.items() if k in Manifest.__annotations__})


async def _restore_keys(url: str, data_dir: Path, keys: dict[str, bytes]) -> None:
    """The API keys, written as the operator: no service's NATS user may write them."""
    if not keys:
        return
    creds = busauth.local_credentials(data_dir)["operator"]
    nc = await nats.connect(url, user=creds.user, password=creds.password)
    try:
        kv = await nc.jetstream().key_value(KEYS_BUCKET)
        for key, value in keys.items():
            await kv.put(key, value)
    finally:
        await nc.close()


async def _indexed(js: JetStreamContext, reg: Registries, timeout: float) -> None:
    """Until ingest has taken every event and every ready document is indexed (or failed)
    in every KB its tags match."""
    deadline = time.monotonic() + timeout
    while True:
        if await _ingest_idle(js):
            kbs = await reg.kbs.list(fresh=True)
            documents = await reg.documents.list(fresh=True)
            wanted = {
                (kb.kb_id, d.document_id)
                for kb in kbs
                for d in documents
                if d.status == DocStatus.ready and d.org_id == kb.org_id and kb.matches(d.tags)
            }
            done = {(e.kb_id, e.document_id) for e in await reg.index.list(fresh=True)}
            failed = {(kb_id, d.document_id) for d in documents for kb_id in d.kb_errors}
            if wanted <= done | failed:
                return
        if time.monotonic() > deadline:
            raise BackupError(
                f"restore: not every document is indexed after {timeout:.0f} s; run "
                "`kbmesh up` on the data dir and it carries on"
            )
        await asyncio.sleep(0.5)


async def _ingest_idle(js: JetStreamContext) -> bool:
    for _subject, durable in (*INGEST_CONSUMERS, (Subject.KB_CHANGED, "ingest-kb-changed")):
        try:
            info = await js.consumer_info(STREAM, durable)
        except NotFoundError:
            return False
        if info.num_pending or info.num_ack_pending:
            return False
    return True
