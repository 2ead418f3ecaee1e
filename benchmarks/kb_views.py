"""What a KB's view, stats and a documents page cost at 100k documents, and what the gateway
pays at start to answer them from memory.

A real nats-server gets `--documents` document records (ready, tagged into one KB) and as
many index entries, written straight into the `documents` and `index` buckets as ingest and
embed would have left them. Then a gateway alone starts on that bus (timed: its start reads
both buckets into its live view, with the RSS it grows by), and `GET /v1/kbs/{kb}`,
`/stats`, `/documents?limit=50` and `/v1/documents?kb=...&limit=50` are timed, `--repeat`
times each (median). Runs against whichever kbmesh is first on PYTHONPATH, so the same
script measures the code before and after a change.

    .venv/bin/python -m benchmarks.kb_views [--documents 100000] [--repeat 5]
    .venv/bin/python -m benchmarks.kb_views --memory-only   # bytes per document in the view
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import httpx
from opentelemetry.sdk.trace import TracerProvider

from services.cli.runtime import build_runtime, gateway_app, start_consuming
from services.common.bus.client import Bus
from services.common.bus.nats_server import NatsServer
from services.common.bus.registry import Registries
from services.common.domain.models import (
    DocStatus,
    DocumentRecord,
    IndexEntry,
    KnowledgeBase,
    RevisionWriter,
    Writer,
    kb_tag,
)
from services.common.settings import Settings

ORG = "local"
KB_ID = "0" * 31 + "1"
# Writes in flight at once: each waits for its JetStream acknowledgement.
WRITES_AT_ONCE = 500
CHUNKS_PER_DOCUMENT = 10


def document(i: int) -> DocumentRecord:
    """A record as ingest leaves a ready git-sourced document: one KB, a label, one writer."""
    doc_id = hashlib.sha256(str(i).encode()).hexdigest()[:32]
    path = f"docs/section-{i // 100}/page-{i}.md"
    return DocumentRecord(
        org_id=ORG,
        document_id=doc_id,
        name=f"page-{i}.md",
        mime_type="text/markdown",
        source_id="git-handbook",
        uri=f"https://git.example.com/acme/handbook/blob/main/{path}",
        source_revision=hashlib.sha1(str(i).encode()).hexdigest(),
        tags=[kb_tag(KB_ID), f"team-{i % 7}"],
        metadata={"path": path, "lang": "en"},
        checksum=hashlib.sha256(f"text {i}".encode()).hexdigest(),
        content_checksum=hashlib.sha256(f"bytes {i}".encode()).hexdigest(),
        size_bytes=4000 + i % 997,
        status=DocStatus.ready,
        kb_ids=[KB_ID],
        last_event_id=hashlib.md5(str(i).encode()).hexdigest(),
        upload_event_id=hashlib.md5(str(i).encode()).hexdigest(),
        recent_events={hashlib.md5(str(i).encode()).hexdigest(): 1},
        writers=[
            RevisionWriter(
                revision=1,
                writer=Writer(kind="source", name="git-handbook"),
                at=datetime.datetime.now(datetime.UTC),
            )
        ],
    )


def entry(record: DocumentRecord) -> IndexEntry:
    return IndexEntry(
        org_id=ORG,
        kb_id=KB_ID,
        document_id=record.document_id,
        revision=record.revision,
        checksum=record.checksum or "",
        settings_version=1,
        chunk_count=CHUNKS_PER_DOCUMENT,
    )


async def load(url: str, n: int) -> None:
    bus = Bus(url, TracerProvider())
    await bus.connect(administer=True)
    try:
        reg = await Registries.open(bus.js)
        kb = KnowledgeBase(org_id=ORG, kb_id=KB_ID, name="views-bench")
        await reg.kbs.put(reg.kbs.key(ORG, KB_ID), kb)
        started = time.perf_counter()
        for first in range(0, n, WRITES_AT_ONCE):
            records = [document(i) for i in range(first, min(first + WRITES_AT_ONCE, n))]
            await asyncio.gather(
                *(reg.documents.kv.put(r.key, r.model_dump_json().encode()) for r in records),
                *(
                    reg.index.kv.put(entry(r).key, entry(r).model_dump_json().encode())
                    for r in records
                ),
            )
        print(f"wrote {n} documents and {n} index entries in {time.perf_counter() - started:.0f} s")
        await reg.close()
    finally:
        await bus.close()


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def measure(url: str, data_dir: Path, repeat: int) -> None:
    settings = Settings(data_dir=data_dir, nats_url=url)
    before = rss_mib()
    started = time.perf_counter()
    rt = await build_runtime(settings, services=("gateway",))
    app = gateway_app(rt)
    try:
        async with app.router.lifespan_context(app):
            await start_consuming(rt)
            print(
                f"gateway start: {time.perf_counter() - started:.1f} s, "
                f"RSS +{rss_mib() - before:.0f} MiB"
            )
            transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 50000))
            async with httpx.AsyncClient(
                transport=transport, base_url="http://127.0.0.1", timeout=600
            ) as client:
                for path in (
                    f"/v1/kbs/{KB_ID}",
                    f"/v1/kbs/{KB_ID}/stats",
                    f"/v1/kbs/{KB_ID}/documents?limit=50",
                    f"/v1/documents?kb={KB_ID}&limit=50",
                ):
                    times = []
                    for _ in range(repeat):
                        t = time.perf_counter()
                        r = await client.get(path)
                        times.append(time.perf_counter() - t)
                        r.raise_for_status()
                    print(f"GET {path}: median {statistics.median(times) * 1000:.1f} ms")
                view = (await client.get(f"/v1/kbs/{KB_ID}")).json()
                print(
                    f"  document_count={view['document_count']} chunk_count={view['chunk_count']}"
                )
    finally:
        await rt.close()


def memory(n: int) -> None:
    """Bytes per document held by the view (tracemalloc), beside the whole pydantic records."""
    from services.gateway.catalog import Catalog

    records = [document(i) for i in range(n)]
    entries = [entry(r) for r in records]
    payloads = [
        (r.model_dump_json(), e.model_dump_json()) for r, e in zip(records, entries, strict=True)
    ]
    del records, entries
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    catalog = Catalog()
    for sequence, (doc, ent) in enumerate(payloads, 1):
        # Each decoded as the watch decodes it, then kept in the view's form only.
        catalog.put_document(DocumentRecord.model_validate_json(doc), sequence)
        catalog.put_entry(IndexEntry.model_validate_json(ent), sequence)
    view = tracemalloc.get_traced_memory()[0] - base
    del catalog
    base = tracemalloc.get_traced_memory()[0]
    whole = [
        (DocumentRecord.model_validate_json(d), IndexEntry.model_validate_json(e))
        for d, e in payloads
    ]
    full = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    print(
        f"view: {view / n:.0f} B per document with its index entry "
        f"({view / 2**20:.0f} MiB at {n}); the whole pydantic records would take "
        f"{full / n:.0f} B ({full / 2**20:.0f} MiB)"
    )
    del whole


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--memory-only", action="store_true")
    args = parser.parse_args()
    if args.memory_only:
        memory(args.documents)
        return
    with tempfile.TemporaryDirectory(prefix="kbmesh-views-") as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            await load(server.url, args.documents)
            await measure(server.url, Path(tmp) / "gateway", args.repeat)
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
