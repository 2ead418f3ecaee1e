"""Backup and restore of a stack: `kbmesh backup FILE`, and `kbmesh restore FILE --data-dir DIR`
(or `--nats-url URL --qdrant-url URL`: onto a new deployment's servers).

The archive holds the source of truth, read over the bus while the stack keeps serving:
KB definitions, API keys (their hashes), stored prompts, every document whose text is
extracted, with its text and original bytes, the audit trail, and the uploads accepted but
not ingested yet. Each document is taken with the text its record describes (the text's
checksum is the record's; a document that changes while it is read is read again), so the
archive never pairs one revision's record with another's text.

It holds the vectors too: each KB's points (dense and sparse vectors, payload) and the index
entries saying which revision of which document they were built from, taken after the
records, so that a restore loads them instead of embedding every chunk again
(services/cli/vectors.py states which points a restore uses; a document whose points do not
describe its record in the archive is embedded again). `restore` builds a new data dir,
writes what the archive holds, loads the vectors (or, with `reembed`, leaves them and embeds
everything again), and runs ingest and embed over it until every document is indexed in every
KB it belongs to, so `kbmesh up` on that dir answers as the backed-up stack did; onto servers
(a NATS cluster, a Qdrant server) it does the same there, for a deployment's services. Documents
still being extracted when the backup ran are left out and listed in the archive's manifest:
upload them again.

The archive is a gzip'd tar. `manifest.json` comes first and lists every other member in
order with its size and SHA-256; then `kv/<bucket>/NNNNNN.jsonl` (key and value per line),
`objects/<name>` (the `texts` object store), `kv/index/NNNNNN.jsonl` (index entries),
`vectors/NNNNNN.jsonl` (one point per line: services/common/store/export.py),
`audit/NNNNNN.jsonl` (the trail, oldest first) and `events/NNNNNN.jsonl` (pending uploads).

Restore trusts nothing it has not checked. It reads the archive front to back with a running
count of the bytes taken (so no header or member can make it hold more than the manifest
declares, and no member more than `member_limit`), checks every member's size and SHA-256
and parses every record before it writes anything, then reads it again to write it,
checking each member again. A malformed or altered archive is one `BackupError` and leaves no
data dir. The checksums catch damage and any edit that does not also rewrite the manifest;
they are no signature: whoever can rewrite the archive can rewrite its manifest, so archives
are protected like the key store. API keys and stored prompts are restored only when asked.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import io
import json
import re
import shutil
import tarfile
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import nats
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_fixed,
)

from services.cli.runtime import SERVICES, Runtime, build_runtime, require_store, start_consuming
from services.cli.vectors import Loader, PointSource, Spooled, VectorSet, as_restored, take
from services.common.bus import auth as busauth
from services.common.bus.audit import (
    AuditEntry,
    audit_subject,
)
from services.common.bus.audit import (
    sink as audit_sink,
)
from services.common.bus.client import Bus
from services.common.bus.registry import (
    ApiKey,
    KbRegistry,
    Registries,
    Registry,
    TextStore,
    read_current,
)
from services.common.domain.content import checksum, content_checksum
from services.common.domain.ids import new_id
from services.common.domain.layout import layout_object
from services.common.domain.models import (
    DocStatus,
    DocumentRecord,
    IndexEntry,
    KnowledgeBase,
    Writer,
)
from services.common.embedders import EmbedderPool
from services.common.messages.answers import Prompt
from services.common.messages.events import KbChanged
from services.common.messages.names import AUDIT_PREFIX, AUDIT_STREAM, KEYS_BUCKET, STREAM, Subject
from services.common.ops.datadir import CURRENT_FORMAT, read_format
from services.common.ops.files import replacing
from services.common.settings import Settings
from services.common.store import VectorStore, create_store
from services.common.store.export import PointRow

# 3: the vectors and the index entries (`kv/index`, `vectors/`), which a version 2 reader
# would refuse as members it does not know.
# 2: every member's size and SHA-256 in the manifest, tables in parts, the audit trail; still
# read: it holds no vectors, so a restore embeds every KB again.
# 1 (no checksums) is refused: nothing in it could be verified.
ARCHIVE_VERSION = 3
OLDEST_VERSION = 2
# Registries taken whole. The index bucket is taken with the vectors (services/cli/vectors.py):
# only the entries whose points are in the archive.
BUCKETS = ("kbs", "keys", "prompts", "documents")
# The parts of an archive in the order backup writes them and restore applies them: KBs and
# records before the texts, index entries before the points they vouch for, the old audit
# trail before anything this restore adds to it, pending uploads last (ingest takes them on
# top of everything else).
SECTIONS = (
    "kv/kbs",
    "kv/keys",
    "kv/prompts",
    "kv/documents",
    "objects",
    "kv/index",
    "vectors",
    "audit",
    "events",
)
VECTOR_SECTIONS = ("kv/index", "vectors")  # not in a version 2 archive
RECORDS: dict[str, type[BaseModel]] = {
    "kv/kbs": KnowledgeBase,
    "kv/keys": ApiKey,
    "kv/prompts": Prompt,
    "kv/documents": DocumentRecord,
    "kv/index": IndexEntry,
}
_PART = re.compile(r"\d{6}\.jsonl")
# What a restore counts as it writes it (`vectors`: the chunk vectors it loaded).
COUNTED = ("kbs", "documents", "objects", "vectors", "keys", "prompts", "audit", "events")

MiB = 1 << 20
# Restore holds one member in memory at a time, at most this many bytes (or the largest
# document the stack accepts, where the operator raised that): tables are cut into parts of
# TABLE_PART_BYTES, and an object is one document's text or original bytes.
MEMBER_BYTES = 64 * MiB
TABLE_PART_BYTES = 8 * MiB
MANIFEST_BYTES = 64 * MiB  # about 350,000 members
# What a tar reader takes beyond the members' data: headers (a long name's extended header
# too), padding, read-ahead. A header larger than this is refused before it is read whole.
HEADER_BYTES = 64 * 1024
READ_CHUNK = MiB

# A document whose text and record disagree is read again this often, this far apart.
READS_PER_DOCUMENT = 5
MID_CHANGE_SECONDS = 0.2
# How often a restore looks whether everything is indexed.
INDEXED_POLL_SECONDS = 0.5
# What ingest consumes from upstream and the gateway, with its durable consumers' names.
INGEST_CONSUMERS = (
    (Subject.DOC_UPLOADED, "ingest-doc-uploaded"),
    (Subject.OCR_DONE, "ingest-ocr-done"),
    (Subject.TAGS_CHANGED, "ingest-tags-changed"),
    (Subject.DOC_DELETED, "ingest-doc-deleted"),
)
INGEST_SUBJECTS = frozenset(str(subject) for subject, _ in INGEST_CONSUMERS)
RESTORE_WRITER = Writer(kind="operator", name="kbmesh restore")


class BackupError(Exception):
    """The archive cannot be written or restored; the message says why."""


class Member(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=1024)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    archive_version: int = ARCHIVE_VERSION
    data_format: int = CURRENT_FORMAT
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())
    counts: dict[str, int] = Field(default_factory=dict)
    # Documents not extracted yet when the backup ran: upload them again after a restore.
    skipped_documents: list[str] = Field(default_factory=list)
    # What built each KB's vectors; a KB not listed has none here and is embedded again.
    vectors: list[VectorSet] = Field(default_factory=list)
    # KBs whose vectors could not be taken, and why.
    vectors_left_out: dict[str, str] = Field(default_factory=dict)
    members: list[Member] = Field(default_factory=list)


class PendingEvent(BaseModel):
    """An upload (or tag change, delete, OCR result) ingest had not taken when the backup ran."""

    model_config = ConfigDict(extra="forbid")

    seq: int
    subject: str
    headers: dict[str, str] = Field(default_factory=dict)
    data: str = Field(description="the message, base64")

    @field_validator("subject")
    @classmethod
    def _ingest_takes_it(cls, subject: str) -> str:
        # Replayed as the stack's own user: only what ingest consumes, never (say) kb.index.
        # An upstream publisher's arrives as `<subject>.upstream.<org>.<publisher>`.
        upstream = busauth.publisher_of(subject) is not None
        if (".".join(subject.split(".")[:2]) if upstream else subject) not in INGEST_SUBJECTS:
            raise ValueError(f"subject {subject} is not one ingest takes")
        return subject

    @field_validator("data")
    @classmethod
    def _base64(cls, data: str) -> str:
        base64.b64decode(data, validate=True)
        return data

    def payload(self) -> bytes:
        return base64.b64decode(self.data)


class _KvRow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str
    value: str


def member_limit(settings: Settings) -> int:
    """The most bytes one member may hold, for backup and restore alike."""
    return max(MEMBER_BYTES, settings.max_content_bytes)


def _section(name: str) -> str | None:
    if name.startswith("objects/") and len(name) > len("objects/"):
        return "objects"
    folder, _, part = name.rpartition("/")
    return folder if folder in SECTIONS and _PART.fullmatch(part) else None


# --- backup -------------------------------------------------------------------------------


def _original(record: DocumentRecord) -> str:
    return f"{record.org_id}/{record.document_id}/original"


async def _entries(js: JetStreamContext, bucket: str) -> dict[str, bytes]:
    return await read_current(await js.key_value(bucket), ">")


async def _document(
    kv: KeyValue, texts: TextStore, key: str
) -> tuple[bytes, dict[str, bytes]] | None:
    """The record at `key` with the objects of that same revision; None when it is not
    extracted yet (or gone). Read again, after a pause, while the text and the record
    disagree: a change is being written."""

    async def read() -> tuple[bytes, dict[str, bytes]] | None:
        try:
            value = (await kv.get(key)).value or b""
        except KeyNotFoundError:  # deleted meanwhile
            return None
        record = DocumentRecord.model_validate_json(value)
        if record.status not in (DocStatus.ready, DocStatus.failed):
            return None
        objects = await _objects(texts, record)
        if objects is None:
            raise _MidChange(key)
        return value, objects

    retrying = AsyncRetrying(
        retry=retry_if_exception_type(_MidChange),
        wait=wait_fixed(MID_CHANGE_SECONDS),
        stop=stop_after_attempt(READS_PER_DOCUMENT),
        reraise=True,
    )
    try:
        return await retrying(read)
    except _MidChange as err:
        raise BackupError(
            f"document {key} kept changing while it was read; run the backup again"
        ) from err


async def _objects(texts: TextStore, record: DocumentRecord) -> dict[str, bytes] | None:
    """The record's text, original bytes and layout, by object name; None when the text or
    the original is not the one the record names."""
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
    if not consistent:
        return None
    objects: dict[str, bytes] = {}
    if text is not None:
        objects[record.text_object] = text
    if original is not None:
        objects[_original(record)] = original
    if layout is not None:
        objects[layout_object(record.org_id, record.document_id)] = layout
    return objects


class _MidChange(Exception):
    """A document's text and record disagree: its new revision is being written."""


async def backup(
    bus: Bus,
    path: Path,
    *,
    limit: int = MEMBER_BYTES,
    open_store: Callable[[], VectorStore] | None = None,
) -> Manifest:
    """Write the archive of the stack behind `bus` to `path` (replaced only when complete);
    no member larger than `limit` (`member_limit`), or a restore would refuse it. The
    vectors are asked of the stack's embed service; where none answers, read from the store
    `open_store` opens (the stack's, when it is stopped)."""
    js = bus.js
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
    documents_kv = await js.key_value("documents")
    for key in buckets["documents"]:
        taken = await _document(documents_kv, texts, key)
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

    members: list[tuple[str, bytes]] = []
    for bucket, entries in buckets.items():
        members += _table(f"kv/{bucket}", _kv_rows(entries))
    members += [(f"objects/{name}", data) for name, data in objects.items()]
    # The vectors go to files beside the archive as they come (a folder of our own, 0700),
    # then into the archive: never all of them in memory.
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.vectors-") as spool:
        source = PointSource(bus, open_store)
        try:
            vectors = await take(
                source,
                [KnowledgeBase.model_validate_json(v) for v in buckets["kbs"].values()],
                [DocumentRecord.model_validate_json(v) for v in documents.values()],
                Registry(await js.key_value("index"), IndexEntry),
                Path(spool),
                TABLE_PART_BYTES,
            )
        finally:
            await source.close()
        index = {e.key: e.model_dump_json().encode() for e in vectors.entries}
        members += _table("kv/index", _kv_rows(index))
        trail = await _audit_trail(js)
        tail = _table("audit", trail) + _table("events", (json.dumps(e).encode() for e in events))

        pieces: list[tuple[str, bytes] | Spooled] = [*members, *vectors.parts, *tail]
        for piece in pieces:
            name, size = (
                (piece.name, piece.size)
                if isinstance(piece, Spooled)
                else (
                    piece[0],
                    len(piece[1]),
                )
            )
            if size > limit:
                raise BackupError(
                    f"{name} is {size} bytes, more than the {limit} a restore takes of one "
                    "member (KBMESH_MAX_CONTENT_BYTES raises it)"
                )
        manifest.counts = {bucket: len(entries) for bucket, entries in buckets.items()}
        manifest.counts |= {
            "objects": len(objects),
            "index": len(index),
            "vectors": sum(v.points for v in vectors.sets),
            "audit": len(trail),
            "events": len(events),
        }
        manifest.vectors, manifest.vectors_left_out = vectors.sets, vectors.left_out
        manifest.members = [
            Member(name=p.name, size=p.size, sha256=p.sha256)
            if isinstance(p, Spooled)
            else Member(name=p[0], size=len(p[1]), sha256=hashlib.sha256(p[1]).hexdigest())
            for p in pieces
        ]

        # A fresh temporary file beside `path`, renamed into place: see
        # services/common/ops/files.py.
        with replacing(path) as out, tarfile.open(fileobj=out, mode="w:gz") as tar:
            head = manifest.model_dump_json(indent=1).encode()
            _add(tar, "manifest.json", io.BytesIO(head), len(head))
            for piece in pieces:
                if isinstance(piece, Spooled):
                    with piece.path.open("rb") as spooled:
                        _add(tar, piece.name, spooled, piece.size)
                else:
                    _add(tar, piece[0], io.BytesIO(piece[1]), len(piece[1]))
    return manifest


def _kv_rows(entries: dict[str, bytes]) -> Iterator[bytes]:
    for key, value in entries.items():
        yield json.dumps({"key": key, "value": value.decode("utf-8")}).encode()


def _table(folder: str, rows: Iterable[bytes]) -> list[tuple[str, bytes]]:
    """JSON lines in parts of about TABLE_PART_BYTES (a longer line is a part of its own)."""
    parts: list[list[bytes]] = []
    size = 0
    for row in rows:
        if not parts or (size + len(row) > TABLE_PART_BYTES and parts[-1]):
            parts.append([])
            size = 0
        parts[-1].append(row)
        size += len(row) + 1
    return [(f"{folder}/{i:06d}.jsonl", b"\n".join(part)) for i, part in enumerate(parts)]


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


async def _audit_trail(js: JetStreamContext) -> list[bytes]:
    """Every entry of the audit trail, oldest first, as stored."""
    try:
        info = await js.stream_info(AUDIT_STREAM)
    except NotFoundError:
        return []
    if not info.state.messages:
        return []
    entries: list[bytes] = []
    sub = await js.subscribe(f"{AUDIT_PREFIX}>", stream=AUDIT_STREAM, ordered_consumer=True)
    try:
        while True:
            msg = await sub.next_msg(timeout=10)
            entries.append(msg.data)
            if msg.metadata.sequence.stream >= info.state.last_seq:
                return entries
    finally:
        await sub.unsubscribe()


def _add(tar: tarfile.TarFile, name: str, data: BinaryIO, size: int) -> None:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = int(time.time())
    info.mode = 0o600
    tar.addfile(info, data)


# --- reading an archive -------------------------------------------------------------------


_T = TypeVar("_T")


class _Overrun(Exception):
    pass


class _Metered(io.RawIOBase):
    """The uncompressed archive with a running count: reading past `ceiling` raises, so no
    tar header, however large it says it is, is ever read whole."""

    def __init__(self, inner: io.BufferedIOBase, ceiling: int) -> None:
        super().__init__()
        self.inner = inner
        self.taken = 0
        self.ceiling = ceiling

    def allow(self, size: int) -> None:
        """Room for the next header and `size` bytes of data."""
        self.ceiling = self.taken + HEADER_BYTES + size

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        room = self.ceiling - self.taken + 1
        data = self.inner.read(room if size is None or size < 0 else min(size, room))
        self.taken += len(data)
        if self.taken > self.ceiling:
            raise _Overrun
        return data


class _Reader:
    """One pass over an archive, front to back: the manifest, checked, then each member it
    lists, in its order, checked against it before it is handed out."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path = path
        self.limit = limit
        self._files = contextlib.ExitStack()

    def __enter__(self) -> _Reader:
        try:
            raw = self._files.enter_context(self.path.open("rb"))
        except OSError as err:
            raise self.error(f"cannot be read: {err.strerror or err}") from None
        unzipped = self._files.enter_context(gzip.GzipFile(fileobj=raw))
        self._meter = _Metered(unzipped, HEADER_BYTES + MANIFEST_BYTES)
        try:
            # Streaming ("r|"): headers are read in order, never looked up by offset.
            opened = self._guard("manifest.json", self._open_tar)
        except BaseException:
            self._files.close()
            raise
        self._tar = self._files.enter_context(opened)
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.close()

    def _open_tar(self) -> tarfile.TarFile:
        return tarfile.open(fileobj=self._meter, mode="r|")

    def error(self, message: str) -> BackupError:
        return BackupError(f"{self.path}: {message}")

    def _guard(self, before: str, step: Callable[[], _T]) -> _T:
        """`step`, its read errors said as what they mean for the archive."""
        try:
            return step()
        except _Overrun:
            raise self.error(
                f"a tar header before {before} is larger than {HEADER_BYTES} bytes, or data "
                "there that the manifest does not declare: not an archive kbmesh wrote"
            ) from None
        except (OSError, EOFError, zlib.error, tarfile.TarError) as err:
            raise self.error(
                f"damaged or not a kbmesh backup (reading {before}: {err or type(err).__name__})"
            ) from None

    def _next(self, before: str) -> tarfile.TarInfo | None:
        return self._guard(before, self._tar.next)

    def _take(self, info: tarfile.TarInfo, size: int) -> bytes:
        """The member's data, read with a running count: never more than `size` bytes."""
        if info.issparse() or not info.isreg():
            raise self.error(f"{info.name} is not a regular file (kbmesh writes no other kind)")
        if info.size != size:
            raise self.error(f"{info.name} is {info.size} bytes; its manifest says {size}")
        source = self._guard(info.name, lambda: self._tar.extractfile(info))
        assert source is not None  # a regular file always has data
        data = bytearray()
        while chunk := self._guard(info.name, lambda: source.read(READ_CHUNK)):
            data += chunk
            if len(data) > size:
                raise self.error(f"{info.name} holds more than its {size} bytes")
        if len(data) != size:
            raise self.error(f"{info.name} ends after {len(data)} of its {size} bytes")
        return bytes(data)

    def manifest(self) -> Manifest:
        info = self._next("manifest.json")
        if info is None or info.name != "manifest.json":
            raise self.error("manifest.json is not its first member: not a kbmesh backup")
        if info.size > MANIFEST_BYTES:
            raise self.error(f"manifest.json is {info.size} bytes, over {MANIFEST_BYTES}")
        try:
            raw = json.loads(self._take(info, info.size))
        except ValueError as err:
            raise self.error(f"manifest.json is not JSON ({err})") from None
        if not isinstance(raw, dict):
            raise self.error("manifest.json is not a JSON object")
        version = raw.get("archive_version")
        if type(version) is not int:
            raise self.error(f"manifest.json names no archive version: {version!r}")
        if version > ARCHIVE_VERSION:
            raise self.error(
                f"written by a newer kbmesh (archive version {version}); this one reads "
                f"version {ARCHIVE_VERSION}"
            )
        if version < OLDEST_VERSION:
            raise self.error(
                f"archive version {version} was written before archives carried checksums, "
                "so nothing in it can be verified: restore it with the kbmesh that wrote it "
                "and take a new backup"
            )
        try:
            manifest = Manifest.model_validate(raw)
        except ValidationError as err:
            raise self.error(f"manifest.json is malformed: {_reason(err)}") from None
        if version < ARCHIVE_VERSION and manifest.vectors:
            raise self.error(f"manifest.json lists vectors: no version {version} archive has any")
        if len({v.kb_id for v in manifest.vectors}) != len(manifest.vectors):
            raise self.error("manifest.json lists the vectors of one KB twice")
        order, names = 0, set()
        for member in manifest.members:
            section = _section(member.name)
            if (
                section is None
                or member.name in names
                or SECTIONS.index(section) < order
                or (version < ARCHIVE_VERSION and section in VECTOR_SECTIONS)
            ):
                raise self.error(
                    f"manifest.json lists {member.name}: not a part of a version {version} "
                    "archive, out of order, or twice"
                )
            order = SECTIONS.index(section)
            names.add(member.name)
            if member.size > self.limit:
                raise self.error(
                    f"{member.name} is {member.size} bytes, more than the {self.limit} "
                    "restore takes of one member (KBMESH_MAX_CONTENT_BYTES raises it)"
                )
        return manifest

    def members(self, manifest: Manifest) -> Iterator[tuple[str, str, bytes]]:
        """(section, name, data) of every member, each checked against the manifest."""
        for expected in manifest.members:
            self._meter.allow(expected.size)
            info = self._next(expected.name)
            if info is None:
                raise self.error(f"{expected.name} is missing: the archive ends before it")
            if info.name != expected.name:
                raise self.error(f"holds {info.name} where its manifest lists {expected.name}")
            data = self._take(info, expected.size)
            if hashlib.sha256(data).hexdigest() != expected.sha256:
                raise self.error(
                    f"{info.name} does not match its checksum: changed or damaged since the "
                    "backup was written"
                )
            section = _section(info.name)
            assert section is not None  # the manifest's names were checked
            yield section, info.name, data
        self._meter.allow(0)
        extra = self._next("the end")
        if extra is not None:
            raise self.error(f"holds {extra.name}, which its manifest does not list")


def _reason(err: ValueError) -> str:
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg']}" if where else first["msg"]
    return str(err)


def _rows(path: Path, name: str, data: bytes, read: Callable[[bytes], _T]) -> list[_T]:
    rows: list[_T] = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if line.strip():
            try:
                rows.append(read(line))
            except ValueError as err:  # JSON, UTF-8, base64 and validation errors alike
                raise BackupError(f"{path}: {name} line {number}: {_reason(err)}") from None
    return rows


def _record_reader(model: type[BaseModel]) -> Callable[[bytes], tuple[str, BaseModel]]:
    def read(line: bytes) -> tuple[str, BaseModel]:
        row = _KvRow.model_validate_json(line)
        record = model.model_validate_json(row.value)
        if _key_of(record) != row.key:
            raise ValueError(f"key {row.key!r} is not its record's ({_key_of(record)!r})")
        return row.key, record

    return read


def _key_of(record: BaseModel) -> str:
    if isinstance(record, KnowledgeBase):
        return KbRegistry.key(record.org_id, record.kb_id)
    if isinstance(record, ApiKey):
        return record.key_hash
    assert isinstance(record, Prompt | DocumentRecord | IndexEntry)
    return record.key


def _audit_entry(line: bytes) -> tuple[AuditEntry, bytes]:
    return AuditEntry.model_validate_json(line), line


def _point_reader(manifest: Manifest) -> Callable[[bytes], PointRow]:
    """Points of the KBs the manifest lists vectors of, each of their dimension."""
    dims = {v.kb_id: v.dim for v in manifest.vectors}

    def read(line: bytes) -> PointRow:
        row = PointRow.model_validate_json(line)
        kb_id = row.payload.get("kb_id")
        if not isinstance(kb_id, str) or kb_id not in dims:
            raise ValueError(f"point {row.id} is of KB {kb_id!r}, whose vectors are not listed")
        if row.dim != dims[kb_id]:
            raise ValueError(
                f"point {row.id} has {row.dim} dense numbers; KB {kb_id}'s have {dims[kb_id]}"
            )
        return row

    return read


def _parse(path: Path, manifest: Manifest, section: str, name: str, data: bytes) -> list[Any]:
    """A member's rows, each checked; objects are bytes and stay as they are."""
    if section == "vectors":
        return _rows(path, name, data, _point_reader(manifest))
    if section in RECORDS:
        return _rows(path, name, data, _record_reader(RECORDS[section]))
    if section == "audit":
        return _rows(path, name, data, _audit_entry)
    if section == "events":
        return _rows(path, name, data, PendingEvent.model_validate_json)
    return []


def check_archive(path: Path, limit: int = MEMBER_BYTES) -> Manifest:
    """The archive's manifest, once every member is read, its size and checksum compared
    with the manifest and every row in it parsed; BackupError naming what is wrong."""
    with _Reader(path, limit) as reader:
        manifest = reader.manifest()
        for section, name, data in reader.members(manifest):
            _parse(path, manifest, section, name, data)
        return manifest


# --- restore ------------------------------------------------------------------------------


@dataclass
class Restored:
    """What a restore wrote (`counts`: kbs, documents, objects, vectors, keys, prompts,
    audit, events), what it left out because it was not asked to (`left_out`: keys,
    prompts), the KBs it embedded again rather than load their vectors (`reembedded`: KB id →
    why), the documents it embedded again because their vectors in the archive were not of
    their revision (`stale_documents`), and the documents the backup itself left out."""

    counts: dict[str, int]
    left_out: dict[str, int]
    skipped_documents: list[str] = field(default_factory=list)
    reembedded: dict[str, str] = field(default_factory=dict)
    stale_documents: int = 0


async def restore(
    path: Path,
    data_dir: Path | None = None,
    *,
    onto: Settings | None = None,
    store: VectorStore | None = None,
    with_keys: bool = False,
    with_prompts: bool = False,
    reembed: bool = False,
    timeout: float = 3600.0,
    embedders: EmbedderPool | None = None,
) -> Restored:
    """What the archive at `path` holds, its vectors loaded (`reembed`: computed again from
    the texts, as for a KB whose vectors the archive lacks or cannot be used), in a new data
    dir at `data_dir`, or `onto` the servers those settings name (`nats_url`, a cluster's
    URLs; `qdrant_url`): a new deployment, holding no KB or document yet. When this returns,
    `kbmesh up` on the data dir, or the deployment's services on the servers, serve the
    backed-up KBs and documents. API keys and stored prompts only `with_keys` /
    `with_prompts`. `store`: the vector store to load (default: the one the settings name);
    `embedders`: the models to embed with (default: those the settings choose)."""
    if data_dir is not None and onto is None:
        if read_format(data_dir) is not None:
            raise BackupError(f"{data_dir} is not empty: restore makes a new data dir")
        settings = Settings(data_dir=data_dir, nats_url=None)
    elif data_dir is None and onto is not None and onto.nats_url:
        settings = onto
    else:
        raise ValueError("restore into a new data dir, or onto servers (a NATS URL): one of them")
    limit = member_limit(settings)
    manifest = check_archive(path, limit)  # before anything is written
    created = False
    if data_dir is not None:
        _check_space(path, manifest, data_dir)
        created = not data_dir.exists()
    # Ingest and embed rebuild the index. The gateway is wired but never started (started,
    # it would add a default KB of its own beside the restored one).
    rt = await build_runtime(
        settings,
        SERVICES,
        embedded_nats=data_dir is not None,
        embedders=embedders,
        # Nobody searches a restore's store: each segment is indexed once, when full.
        store=store or create_store(settings, bulk=True),
    )
    written = False
    try:
        if data_dir is None:
            await _check_new_deployment(rt, manifest)
        await start_consuming(rt)
        async with _as_operator(rt, data_dir) as operator:
            restorer = _Restorer(rt, operator, path, manifest, with_keys, with_prompts, reembed)
            # Read and checked again as it is written: the file may have changed since.
            with _Reader(path, limit) as reader:
                if reader.manifest() != manifest:
                    raise reader.error("changed since it was checked")
                for section, name, data in reader.members(manifest):
                    await restorer.take(section, name, data)
            await restorer.settle()
        written = True
        await _indexed(rt.bus.js, rt.registries, timeout)
    finally:
        await rt.close()
        if not written and data_dir is not None:
            # The archive changed under the restore, or the bus failed: no half-written data
            # dir is left to be taken for a restored one.
            _discard(data_dir, created)
    loader = restorer.vectors
    return Restored(
        restorer.counts,
        restorer.left_out,
        manifest.skipped_documents,
        loader.reembedded,
        loader.stale_documents,
    )


@contextlib.asynccontextmanager
async def _as_operator(rt: Runtime, data_dir: Path | None) -> AsyncIterator[JetStreamContext]:
    """The operator's connection: the only user that may write API keys, and the audit trail
    of every kind. In a new data dir, its recorded user; on servers, the restore connects as
    the operator already (KBMESH_NATS__USER)."""
    if data_dir is None:
        yield rt.bus.js
        return
    creds = busauth.local_credentials(data_dir)["operator"]
    nc = await nats.connect(rt.bus.url or "", user=creds.user, password=creds.password)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


async def _check_new_deployment(rt: Runtime, manifest: Manifest) -> None:
    """Servers are restored onto only while they hold no KB and no document, and none of the
    archive's collections: the archive's records and points would mix with what is there."""
    reg = rt.registries
    if await reg.kbs.list(fresh=True) or await reg.documents.list(fresh=True):
        raise BackupError(
            f"NATS at {rt.bus.url} already holds KBs or documents: a restore onto servers fills "
            "a new deployment"
        )
    store = require_store(rt)
    for vector_set in manifest.vectors:
        if await store.collection_exists(vector_set.collection):
            raise BackupError(
                f"the vector store already holds collection {vector_set.collection}: a restore "
                "onto servers fills a new deployment"
            )


def _check_space(path: Path, manifest: Manifest, data_dir: Path) -> None:
    needed = sum(member.size for member in manifest.members)
    where = next(p for p in (data_dir, *data_dir.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if needed > free:
        raise BackupError(f"{path}: holds {needed} bytes; {where} has {free} free")


def _discard(data_dir: Path, created: bool) -> None:
    if created:
        shutil.rmtree(data_dir, ignore_errors=True)
        return
    for child in data_dir.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


class _Restorer:
    """Writes the checked members of an archive into a new stack, section by section."""

    def __init__(
        self,
        rt: Runtime,
        operator: JetStreamContext,
        path: Path,
        manifest: Manifest,
        with_keys: bool,
        with_prompts: bool,
        reembed: bool,
    ) -> None:
        self.rt = rt
        self.operator = operator
        self.path = path
        self.manifest = manifest
        self.with_keys = with_keys
        self.with_prompts = with_prompts
        self.counts = dict.fromkeys(COUNTED, 0)
        self.left_out: dict[str, int] = {}
        self.kbs: list[KnowledgeBase] = []
        self.keys: list[ApiKey] = []
        self.orgs: set[str] = set()
        self.settled = False
        self.vectors = Loader(
            require_store(rt),
            rt.registries.index,
            rt.embedders,
            {v.kb_id: v for v in manifest.vectors},
            reembed,
        )

    async def take(self, section: str, name: str, data: bytes) -> None:
        if section == "objects":
            await self.rt.registries.texts.put(name.removeprefix("objects/"), data)
            self.counts["objects"] += 1
        elif section == "audit":
            # The vectors are all in: their indexes are built before anything else is written
            # (a build holds the interpreter lock, and a write waiting on the bus meanwhile
            # would time out).
            await self._vectors_done()
            # The archive's trail as it was, each entry under its own id (de-duplicated).
            for entry, raw in _rows(self.path, name, data, _audit_entry):
                await self.operator.publish(
                    audit_subject(entry.org_id, entry.kind),
                    raw,
                    headers={"Nats-Msg-Id": entry.event_id},
                    stream=AUDIT_STREAM,
                )
                self.counts["audit"] += 1
        elif section == "vectors":
            await self.vectors.points(_rows(self.path, name, data, _point_reader(self.manifest)))
        elif section == "events":
            await self.settle()
            for event in _rows(self.path, name, data, PendingEvent.model_validate_json):
                await self.rt.bus.js.publish(
                    event.subject, event.payload(), headers=event.headers or None, stream=STREAM
                )
                self.counts["events"] += 1
        else:
            for key, record in _rows(self.path, name, data, _record_reader(RECORDS[section])):
                await self._record(key, record)

    async def _record(self, key: str, record: BaseModel) -> None:
        reg = self.rt.registries
        if isinstance(record, KnowledgeBase):
            # The collections a rebuild was reading from are not in the archive: the
            # restored KB serves the generation the archive's vectors were taken from.
            record = as_restored(record)
            await reg.kbs.put(key, record)
            self.vectors.kb(record)
            self.kbs.append(record)
            self._count("kbs", record.org_id)
        elif isinstance(record, DocumentRecord):
            record.kb_ids, record.kb_errors = [], {}  # membership is decided again below
            await reg.documents.put(key, record)
            self.vectors.document(record)
            self._count("documents", record.org_id)
        elif isinstance(record, ApiKey):
            if not self.with_keys:
                self.left_out["keys"] = self.left_out.get("keys", 0) + 1
                return
            kv = await self.operator.key_value(KEYS_BUCKET)
            await kv.put(key, record.model_dump_json().encode())
            self.keys.append(record)
            self._count("keys", record.org_id)
        elif isinstance(record, IndexEntry):
            await self.vectors.entry(record)
        elif isinstance(record, Prompt):
            if not self.with_prompts:
                self.left_out["prompts"] = self.left_out.get("prompts", 0) + 1
                return
            await reg.prompts.put(key, record)
            self._count("prompts", record.org_id)

    def _count(self, what: str, org_id: str) -> None:
        self.counts[what] += 1
        self.orgs.add(org_id)

    async def _vectors_done(self) -> None:
        if not self.vectors.finished:
            await self.vectors.finish()
            self.counts["vectors"] = self.vectors.loaded

    async def settle(self) -> None:
        """Once everything but the pending uploads is written: the restore and each key it
        brought on the audit trail (after the archive's own entries), and ingest told of
        every KB, so it decides membership before it takes the uploads."""
        if self.settled:
            return
        self.settled = True
        # Before ingest hears of the KBs: the documents it then sends to embed find their
        # entries, and only those without (or whose points were not whole) are embedded.
        await self._vectors_done()
        audit = audit_sink(lambda: self.operator)
        for org_id in sorted(self.orgs or {self.rt.settings.default_org}):
            await audit(
                AuditEntry(
                    event_id=new_id(),
                    org_id=org_id,
                    kind="backup",
                    action="restored",
                    writer=RESTORE_WRITER,
                    name=f"{self.path.name} (written {self.manifest.created_at})",
                )
            )
        for key in self.keys:
            await audit(
                AuditEntry(
                    event_id=new_id(),
                    org_id=key.org_id,
                    kind="key",
                    action="restored",
                    writer=RESTORE_WRITER,
                    key_id=key.key_hash[:12],  # its public id (gateway.auth.key_id)
                    name=key.name or None,
                )
            )
        for kb in self.kbs:
            await self.rt.bus.publish(
                Subject.KB_CHANGED, KbChanged(org_id=kb.org_id, kb_id=kb.kb_id, change="created")
            )


async def _indexed(js: JetStreamContext, reg: Registries, timeout: float) -> None:
    """Until ingest has taken every event and every ready document is indexed (or failed)
    in every KB its tags match."""

    async def indexed() -> bool:
        if not await _ingest_idle(js):
            return False
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
        return wanted <= done | failed

    retrying = AsyncRetrying(
        retry=retry_if_result(lambda done: not done),
        wait=wait_fixed(INDEXED_POLL_SECONDS),
        stop=stop_after_delay(timeout),
    )
    try:
        await retrying(indexed)
    except RetryError as err:
        raise BackupError(
            f"restore: not every document is indexed after {timeout:.0f} s; run "
            "`kbmesh up` on the data dir and it carries on"
        ) from err


async def _ingest_idle(js: JetStreamContext) -> bool:
    for _subject, durable in (*INGEST_CONSUMERS, (Subject.KB_CHANGED, "ingest-kb-changed")):
        try:
            info = await js.consumer_info(STREAM, durable)
        except NotFoundError:
            return False
        if info.num_pending or info.num_ack_pending:
            return False
    return True
