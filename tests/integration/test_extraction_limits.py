"""Documents read within bounds, through the real pipeline: a decompression bomb fails alone
with the limit it broke named in its reason, on its first delivery (a document that broke a
limit, or broke the reader, would break it again), the serving process (this one: the whole
stack runs in it) does not grow, and searches keep their latency while the bomb is being read
in its child process."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import statistics
import time
import zipfile
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import running_stack
from tests.support.archives import damaged_deck, lying_deck
from tests.support.domain import create_kb, uid, upload

# The static guards (expansion ratio and size) are opened wide here so that the bombs reach
# the extraction child and meet its memory and time limits; tests/unit/test_extract.py
# proves the static guards.
LIMITS = {
    "extract_memory_mb": 400,
    "extract_seconds": 30,
    "extract_expansion_ratio": 10**6,
    "extract_expanded_bytes": 4 * 1024**3,
}
SAMPLES = 80
# A redelivered upload waits 0.5 s, then 2 s, 5 s and 15 s before its next tries: a refusal
# within this many seconds was refused on its first delivery.
FIRST_DELIVERY_SECONDS = 10.0


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    async with running_stack(
        tmp_path_factory.mktemp("limits"), embedders=embedders, limits=LIMITS
    ) as (rt, client):
        yield rt, client


@pytest.fixture(scope="module")
async def default_stack(tmp_path_factory, embedders) -> AsyncIterator[httpx.AsyncClient]:
    """The limits of a fresh `kbmesh up`."""
    async with running_stack(tmp_path_factory.mktemp("defaults"), embedders=embedders) as (
        _rt,
        client,
    ):
        yield client


@pytest.fixture(scope="module")
def lying_bomb() -> bytes:
    """0.6 MB: a presentation whose slide inflates to 600 MB while it declares 3 kB."""
    return lying_deck(600 * 1024 * 1024)


def gzip_bomb(expanded: int) -> bytes:
    """`expanded` bytes of zeros, gzip-compressed in steps (never held whole here)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    block = bytes(1024 * 1024)
    parts = [packer.compress(block) for _ in range(expanded // len(block))]
    return b"".join([*parts, packer.flush()])


def docx_bomb(paragraphs: int) -> bytes:
    """A DOCX holding millions of empty paragraphs: a few hundred kB that a reader spends
    seconds and hundreds of megabytes on."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr(
            "[Content_Types].xml",
            '<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/'
            'content-types"><Default Extension="xml" ContentType="application/xml"/>'
            '<Override PartName="/word/document.xml" ContentType="application/vnd.'
            'openxmlformats-officedocument.wordprocessingml.document.main+xml"/></Types>',
        )
        z.writestr(
            "word/document.xml",
            '<?xml version="1.0"?><w:document xmlns:w="http://schemas.openxmlformats.org/'
            'wordprocessingml/2006/main"><w:body>' + "<w:p/>" * paragraphs + "</w:body>"
            "</w:document>",
        )
    return out.getvalue()


async def upload_bytes(client: httpx.AsyncClient, name: str, data: bytes) -> httpx.Response:
    body = {"name": name, "content": base64.b64encode(data).decode(), "content_encoding": "base64"}
    return await client.post("/v1/documents?wait=true", json=body)


async def refused_once(
    client: httpx.AsyncClient, data: bytes, status: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Upload `data` (wait=true) and return the problem body and the dead letter of a refusal
    on the first delivery: answered `status` within seconds, dead-lettered after one
    delivery, none of its content stored (the new document reads `failed` with the reason)."""
    name = f"deck-{uid()}.pptx"
    started = time.perf_counter()
    r = await upload_bytes(client, name, data)
    elapsed = time.perf_counter() - started
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json", r.headers
    assert elapsed < FIRST_DELIVERY_SECONDS, f"answered after {elapsed:.1f} s"
    letters = (await client.get("/v1/dead-letters", params={"subject": "doc.uploaded"})).json()
    (letter,) = [item for item in letters["items"] if item["name"] == name]
    assert letter["delivered"] == 1, letter
    assert letter["error_type"] == r.json()["error_type"], (letter, r.text)
    record = (await client.get(f"/v1/documents/{letter['document_id']}")).json()
    assert record["status"] == "failed", record
    assert record["error"][:200] == letter["error"][:200], (record, letter)
    assert record["size_bytes"] == 0 and record["content_checksum"] is None, record
    return r.json(), letter


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/self/status")


async def search_seconds(client: httpx.AsyncClient, kb_id: str) -> float:
    started = time.perf_counter()
    r = await client.post(
        "/v1/search", json={"query": "how are the pumps cooled", "kb_ids": [kb_id]}
    )
    assert r.status_code == 200, r.text
    return time.perf_counter() - started


def p95(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=20)[-1]


async def test_bombs_fail_alone_with_the_limit_named(stack):
    """A gzip bomb runs the reading child out of memory; a DOCX of millions of empty
    paragraphs runs it out of memory or time. Each upload is refused (422) with the setting
    to change in its reason, goes to the dead letters, and a normal document still loads."""
    _rt, client = stack
    r = await upload_bytes(client, "zeros.md.gz", gzip_bomb(1024 * 1024 * 1024))
    assert r.status_code == 422, r.text
    assert "KBMESH_LIMITS__EXTRACT_MEMORY_MB" in r.json()["detail"], r.text

    # 16 million paragraphs: 8 million were read within 400 MB and 30 s on a fast machine.
    r = await upload_bytes(client, "empty.docx", docx_bomb(16_000_000))
    assert r.status_code == 422, r.text
    assert "KBMESH_LIMITS__EXTRACT_" in r.json()["detail"], r.text

    letters = (await client.get("/v1/dead-letters", params={"subject": "doc.uploaded"})).json()
    reasons = [item["error"] for item in letters["items"]]
    assert any("EXTRACT_MEMORY_MB" in reason for reason in reasons), reasons
    ok = await upload(client, "fine.md", "# Fine\n\nReadable after the bombs.", kb_id="default")
    assert ok["status"] == "complete", ok


async def test_a_zip_bomb_that_lies_about_its_sizes_is_refused_on_its_first_delivery(
    default_stack, lying_bomb
):
    """With the limits of a fresh `kbmesh up`, a presentation whose slide inflates to 600 MB
    while both its headers declare 3 kB is refused as too large (413, naming the setting)
    within seconds: its members are inflated and counted before the reader gets them. It is
    dead-lettered on its first delivery and nothing is stored."""
    problem, letter = await refused_once(default_stack, lying_bomb, 413)
    assert problem["error_type"] == "ContentTooLarge", problem
    assert "KBMESH_LIMITS__EXTRACT_EXPANDED_BYTES" in problem["detail"], problem
    assert "KBMESH_LIMITS__EXTRACT_EXPANDED_BYTES" in letter["error"], letter


async def test_a_lying_bomb_past_the_size_guards_meets_the_memory_cap_once(stack, lying_bomb):
    """With the size guards opened wide, the same bomb reaches the reader, which runs out of
    memory at the child's cap: that is the memory limit (422 naming its setting) on the first
    delivery, not an error to retry."""
    _rt, client = stack
    problem, letter = await refused_once(client, lying_bomb, 422)
    assert "KBMESH_LIMITS__EXTRACT_MEMORY_MB" in problem["detail"], problem
    assert "KBMESH_LIMITS__EXTRACT_MEMORY_MB" in letter["error"], letter


async def test_a_document_that_breaks_the_reader_fails_without_retries(default_stack):
    """A presentation whose slide's checksum is wrong makes the reader fail with an error
    outside its own error types (an I/O error): the document failed (422 with the reader's
    reason) on its first delivery, since the same bytes would fail the same way again."""
    problem, letter = await refused_once(default_stack, damaged_deck(), 422)
    assert problem["error_type"] == "ValidationError", problem
    assert "checksum" in problem["detail"].lower(), problem
    assert "checksum" in letter["error"].lower(), letter
    ok = await upload(default_stack, "fine.md", "# Fine\n\nRead after the damaged deck.")
    assert ok["status"] in ("stored", "complete"), ok


async def test_searches_keep_their_latency_and_the_server_its_memory_during_a_bomb(stack):
    """p95 of searches while DOCX bombs are read (one after another, in the extraction
    child) stays within twice the p95 of the same searches idle; the serving process's peak
    memory grows by less than 150 MB (reading the same bomb in-process grew it by over a
    gigabyte)."""
    _rt, client = stack
    kb = await create_kb(client)
    await upload(
        client,
        "pumps.md",
        "# Pumps\n\nThe pumps are cooled by the chiller loop.\n\n## Checks\n\nLog the flow.",
        kb_id=kb["kb_id"],
    )
    for _ in range(5):  # warm: query cache off the path, connections open
        await search_seconds(client, kb["kb_id"])
    idle = [await search_seconds(client, kb["kb_id"]) for _ in range(SAMPLES)]

    bomb = docx_bomb(8_000_000)
    peak_before = peak_rss_mb()
    busy: list[float] = []
    refused = 0
    # Searches are timed only while a bomb is being read, however quickly a machine reads it
    # (from under a second to several): bombs go in one after another until enough are.
    for _ in range(200):
        if len(busy) >= SAMPLES:
            break
        reading = asyncio.create_task(upload_bytes(client, "empty.docx", bomb))
        await asyncio.sleep(0.05)  # the upload reaches the reading child
        while not reading.done() and len(busy) < SAMPLES:
            busy.append(await search_seconds(client, kb["kb_id"]))
        r = await reading
        assert r.status_code == 422, r.text
        refused += 1
    growth = peak_rss_mb() - peak_before

    assert len(busy) >= SAMPLES, f"{refused} bombs gave only {len(busy)} searches"
    assert growth < 150, f"the serving process grew by {growth:.0f} MB"
    idle_p95, busy_p95 = p95(idle), p95(busy)
    # A floor of 20 ms: on an idle fast machine a search takes a few milliseconds, and twice
    # a few milliseconds is within the noise of any shared machine.
    assert busy_p95 <= 2 * max(idle_p95, 0.02), (
        f"p95 idle {idle_p95 * 1000:.1f} ms, during the bomb {busy_p95 * 1000:.1f} ms"
    )


async def test_a_document_past_the_time_limit_is_stopped_and_the_next_one_reads():
    """The reader of a document that takes too long is killed with its process; the pool
    replaces it, and the next document is read."""
    from services.common.domain.limits import LimitSettings
    from services.ingest.sandbox import ExtractionFailed, Extractor

    # Time runs out first: 16 million paragraphs keep kreuzberg busy well past 0.3 s on every
    # machine measured, even idle; the next document, a few bytes of markdown, is quick.
    limits = {**LIMITS, "extract_seconds": 0.3, "extract_memory_mb": 4096}
    extractor = Extractor(LimitSettings(**limits))
    try:
        with pytest.raises(ExtractionFailed, match="KBMESH_LIMITS__EXTRACT_SECONDS"):
            await extractor.extract(docx_bomb(16_000_000), None, "empty.docx")
        read = await extractor.extract(b"# Fine\n\nStill read.", None, "fine.md")
        assert read.text.startswith("# Fine") and read.layout.format == "markdown"
    finally:
        extractor.close()


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_a_reader_process_that_dies_fails_its_document_once_and_the_next_one_reads():
    """A reader whose process dies while it reads a document (killed here, as the kernel's
    out-of-memory killer or a crash in native code ends it) fails that document for good,
    naming the signal; the pool replaces the process, and the next document is read."""
    import multiprocessing

    from services.common.domain.limits import LimitSettings
    from services.ingest.sandbox import ExtractionFailed, Extractor

    limits = {**LIMITS, "extract_workers": 1, "extract_memory_mb": 4096}
    extractor = Extractor(LimitSettings(**limits))
    before = set(multiprocessing.active_children())
    try:
        await extractor.extract(b"# Warm\n\nThe reader is up.", None, "warm.md")
        (child,) = set(multiprocessing.active_children()) - before
        idle = cpu_seconds(child.pid)
        reading = asyncio.create_task(extractor.extract(docx_bomb(16_000_000), None, "empty.docx"))
        deadline = time.monotonic() + 60
        # An idle reader uses no CPU: once it has, it is reading the document.
        while cpu_seconds(child.pid) < idle + 0.2:
            assert time.monotonic() < deadline and not reading.done(), "it never read"
            await asyncio.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(ExtractionFailed, match="SIGKILL") as refused:
            await reading
        assert not refused.value.retryable
        read = await extractor.extract(b"# Fine\n\nStill read.", None, "fine.md")
        assert read.text.startswith("# Fine")
    finally:
        extractor.close()


def test_the_extractor_starts_its_readers_before_the_first_document():
    """`start()` (called as the ingest service starts) spawns every reading child, each
    importing the readers, so the first upload does not wait for them."""
    import multiprocessing

    from services.common.domain.limits import LimitSettings
    from services.ingest.sandbox import Extractor

    before = set(multiprocessing.active_children())
    extractor = Extractor(LimitSettings(extract_workers=2))
    try:
        extractor.start()
        deadline = time.monotonic() + 60
        while len(set(multiprocessing.active_children()) - before) < 2:
            assert time.monotonic() < deadline, "the reading children were not started"
            time.sleep(0.05)
    finally:
        extractor.close()
