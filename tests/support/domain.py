"""Helpers for the domain integration tests: waiting for the bus to settle, counting vectors,
computing what chunking must produce, and small documents long enough to chunk differently
at 50 and 120 tokens."""

from __future__ import annotations

import asyncio
import io
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from services.common.domain.models import DEFAULT_MODEL, KnowledgeBase
from services.common.messages.events import DocUploaded
from services.common.messages.names import STREAM, Subject
from services.common.store import Filter, Match
from services.embed.chunking import chunk_text
from services.embed.service import TITLE_TOKEN_BUDGET
from tests.support.bus import as_operator

T = TypeVar("T")

# Three topics, ~250-300 model tokens each: several chunks at 50 tokens, two or three at 120.
LONG_DOCS = {
    "glaciers.md": (
        "# Glaciers\n\n"
        "A glacier is a persistent body of dense ice that is constantly moving under its own "
        "weight. Glaciers form where the accumulation of snow exceeds its ablation over many "
        "years, often centuries. They slowly deform and flow because of stresses induced by "
        "their weight, creating crevasses, seracs and other distinguishing features.\n\n"
        "Glaciers abrade rock and debris from their substrate to create landforms such as "
        "cirques, moraines and fjords. Meltwater from glaciers feeds rivers in summer and is "
        "an important source of fresh water for many communities downstream.\n\n"
        "On Earth, about ten percent of the land area is covered by glacial ice. The largest "
        "ice sheets are in Antarctica and Greenland. Mountain glaciers exist on every "
        "continent except Australia, and most of them have been retreating since the end of "
        "the Little Ice Age as the climate warms."
    ),
    "espresso.md": (
        "# Pulling espresso\n\n"
        "Espresso is coffee brewed by forcing a small amount of nearly boiling water under "
        "pressure through finely ground coffee beans. A typical shot uses about eighteen "
        "grams of ground coffee and yields roughly thirty-six grams of liquid in twenty-five "
        "to thirty seconds.\n\n"
        "The grind size controls how fast water flows through the puck. Too coarse and the "
        "shot runs fast, tasting sour and thin; too fine and it chokes, tasting bitter and "
        "harsh. Baristas adjust the grinder a little at a time and taste after each change.\n\n"
        "Fresh beans release carbon dioxide, which forms the crema on top of the shot. Beans "
        "are usually best between one and four weeks after roasting. Tamping evenly and "
        "distributing the grounds well avoids channeling, where water finds a weak path and "
        "under-extracts the rest of the coffee."
    ),
    "raft.md": (
        "# The Raft consensus algorithm\n\n"
        "Raft is a consensus algorithm designed to be easy to understand. It manages a "
        "replicated log across a cluster of servers so that they agree on the same sequence "
        "of commands even when some servers fail.\n\n"
        "Raft elects a leader with randomized election timeouts. Followers that hear nothing "
        "from a leader become candidates and request votes; a candidate that wins a majority "
        "becomes leader for a new term. The leader accepts client requests and appends them "
        "to its log.\n\n"
        "The leader replicates log entries to followers and marks an entry committed once a "
        "majority stores it. Committed entries are applied to the state machine in order. "
        "Safety rules ensure that a newly elected leader already holds every committed "
        "entry, so no committed command is ever lost or reordered."
    ),
}

# Queries that share obvious words with one long document.
LONG_QUERIES = {
    "glaciers.md": "glacier ice flow moraines fjords",
    "espresso.md": "espresso grind size crema shot",
    "raft.md": "raft leader election replicated log",
}


def uid() -> str:
    return uuid.uuid4().hex[:8]


def embed_count(rt: Any) -> int:
    """Texts the default model embedded so far (no re-embedding is proved by it not moving)."""
    return int(rt.embedders.get(DEFAULT_MODEL).embed_count)


async def create_kb(client: Any, **body: Any) -> dict[str, Any]:
    body.setdefault("name", f"kb-{uid()}")
    r = await client.post("/v1/kbs", json=body)
    assert r.status_code == 201, r.text
    result: dict[str, Any] = r.json()
    return result


async def upload(client: Any, name: str, content: str, **body: Any) -> dict[str, Any]:
    r = await client.post(
        "/v1/documents?wait=true", json={"name": name, "content": content, **body}
    )
    assert r.status_code in (200, 202), r.text
    result: dict[str, Any] = r.json()
    return result


async def wait_until(
    check: Callable[[], Awaitable[T]],
    *,
    timeout: float = 60.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll `check()` until it returns a truthy value (returned), or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


async def settled(rt: Any, *, timeout: float = 60.0) -> None:
    """Wait until every durable consumer on the event stream has nothing pending or unacked.

    Consumers are read in pipeline order (ingest before embed), and the whole snapshot must
    be clean twice in a row: a handler publishes its follow-up events before it acks, so a
    clean ingest followed by a clean embed means no work is in flight anywhere."""

    async def clean() -> bool:
        for _ in range(2):
            infos = await rt.bus.js.consumers_info(STREAM)
            infos.sort(key=lambda i: (not i.name.startswith("ingest"), i.name))
            if any(i.num_pending or i.num_ack_pending for i in infos):
                return False
        return True

    await wait_until(clean, timeout=timeout, what="the event stream to settle")


async def collection_of(rt: Any, kb_id: str) -> str:
    """The collection embed writes for the KB: a reindex builds a new generation."""
    for kb in await rt.registries.kbs.list():
        if kb.kb_id == kb_id:
            name: str = kb.collection_name
            return name
    return f"kb_{kb_id}"


async def vector_count(rt: Any, kb_id: str, document_id: str | None = None) -> int:
    store = rt.store
    flt = Filter(must=(Match("document_id", document_id),)) if document_id else None
    return await store.count(await collection_of(rt, kb_id), flt)


async def total_vectors(rt: Any) -> int:
    kbs = await rt.registries.kbs.list()
    return sum([await vector_count(rt, kb.kb_id) for kb in kbs])


async def object_count(rt: Any) -> int:
    """Objects (texts, originals, staged uploads) in the `texts` object store."""
    from nats.js.errors import NotFoundError

    try:
        return len(await rt.registries.texts.store.list(ignore_deletes=True))
    except NotFoundError:
        return 0


async def uploaded_events(rt: Any) -> dict[str, DocUploaded]:
    """Every doc.uploaded event in the stream so far, by document id (the last one wins);
    read as the operator, the one user that may open a reader of its own on the stream."""
    async with as_operator(rt) as nc:
        js = nc.jetstream()
        sub = await js.subscribe(Subject.DOC_UPLOADED, stream=STREAM, ordered_consumer=True)
        seen: dict[str, DocUploaded] = {}
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=2)
                except TimeoutError:
                    return seen  # an empty stream
                event = DocUploaded.model_validate_json(msg.data)
                seen[event.document_id or ""] = event
                if msg.metadata.num_pending == 0:
                    return seen
        finally:
            await sub.unsubscribe()


async def registry_counts(rt: Any) -> dict[str, int]:
    """Everything an input can change: KBs, documents, index entries, stored objects and
    vectors."""
    reg = rt.registries
    return {
        "kbs": len(await reg.kbs.list()),
        "documents": len(await reg.documents.list()),
        "index": len(await reg.index.list()),
        "objects": await object_count(rt),
        "vectors": await total_vectors(rt),
    }


async def dead_letters(rt: Any, subject: str, *, timeout: float = 0.5) -> dict[str, Any]:
    """Dead letters of `subject` so far, by the original event's id (headers, with the
    reason under `Kbmesh-Error`). Call after `settled`: a consumer dead-letters before it
    acks."""
    import json

    out: dict[str, Any] = {}
    async with as_operator(rt) as nc:  # services may not read the dead letters this way
        sub = await nc.jetstream().subscribe(f"dlq.*.{subject}", stream="KBMESH_DLQ", durable=None)
        while True:
            try:
                msg = await sub.next_msg(timeout=timeout)
            except TimeoutError:
                break
            try:
                event_id = json.loads(msg.data).get("event_id")
            except ValueError:
                continue
            out[event_id] = msg.headers
    return out


def expected_chunks(
    rt: Any, kb: dict[str, Any] | KnowledgeBase, text: str, title: str
) -> list[str]:
    """The chunk texts embed must produce for `text` in `kb` (its chunker, size, overlap and
    the model's limit less the title's share), computed independently of the bus."""
    if not isinstance(kb, KnowledgeBase):
        kb = KnowledgeBase(
            org_id="x", **{k: v for k, v in kb.items() if k in KnowledgeBase.model_fields}
        )
    embedder = rt.embedders.get(kb.embedding_model, kb.api_base)
    title_tokens = min(embedder.count_tokens(title) + 1, TITLE_TOKEN_BUDGET)
    chunks = chunk_text(
        text, kb, embedder.tokenizer(), max_tokens=embedder.max_tokens - title_tokens
    )
    return [c.text for c in chunks]


async def stored_chunks(rt: Any, kb_id: str, document_id: str) -> list[str]:
    """The document's chunk contents in `kb_id`, in chunk order."""
    store = rt.store
    hits = await store.scroll(
        await collection_of(rt, kb_id), Filter(must=(Match("document_id", document_id),)), 1000
    )
    return [h.payload["content"] for h in sorted(hits, key=lambda h: h.payload["chunk_index"])]


def blank_pdf() -> bytes:
    """A one-page PDF without a text layer: what a scanner produces, as far as text goes."""
    from pypdf import PdfWriter

    writer = PdfWriter()
    writer.add_blank_page(width=595, height=842)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def text_pdf(text: str) -> bytes:
    """A one-page PDF with `text` in its text layer (Helvetica, one line)."""
    from pypdf import PdfWriter
    from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject

    writer = PdfWriter()
    page = writer.add_blank_page(width=595, height=842)
    font = DictionaryObject(
        {
            NameObject("/Type"): NameObject("/Font"),
            NameObject("/Subtype"): NameObject("/Type1"),
            NameObject("/BaseFont"): NameObject("/Helvetica"),
        }
    )
    page[NameObject("/Resources")] = DictionaryObject(
        {NameObject("/Font"): DictionaryObject({NameObject("/F1"): writer._add_object(font)})}
    )
    escaped = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
    stream = DecodedStreamObject()
    stream.set_data(f"BT /F1 12 Tf 50 800 Td ({escaped}) Tj ET".encode("latin-1"))
    page[NameObject("/Contents")] = writer._add_object(stream)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()
