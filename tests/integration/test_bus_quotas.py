"""What an upstream publisher can put on kbmesh's disk: the server that `kbmesh up` runs, with
the users and publisher accounts busauth renders and the streams every service declares,
and no consumer draining them (so that what is held is what was let in).

- each publisher holds a bounded backlog per event kind: past it, its publishes are refused
  (the others' are not), until ingest has processed its events;
- the stream of publishers' events never grows past its byte limit: when it is full, new
  events are refused, nothing stored is dropped;
- no single event is larger than a dead letter can carry;
- one org's dead letters, however many, evict only that org's oldest of the same subject."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from opentelemetry import trace

from services.common.bus.auth import (
    PublisherRecord,
    add_publisher,
    local_accounts,
    recorded_credentials,
)
from services.common.bus.client import Bus
from services.common.bus.nats_server import NatsServer
from services.common.messages.events import DocUploaded, OcrDone
from services.common.settings import BusSettings

UPSTREAM = "KBMESH_UPSTREAM"
DEAD_LETTERS = "KBMESH_DLQ"
MIB = 1024 * 1024


@pytest.fixture
async def bus(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """A private nats-server with kbmesh's roles and two publishers (org-a's `flood`, org-b's
    `fair`), its streams declared by a service's connection with 1 MiB per stream."""
    publishers = {
        "flood": add_publisher(tmp_path, "flood", "org-a"),
        "fair": add_publisher(tmp_path, "fair", "org-b"),
    }
    server = NatsServer(tmp_path / "nats", accounts=lambda: local_accounts(tmp_path)).start()
    service = Bus(
        server.url,
        trace.get_tracer_provider(),
        recorded_credentials(tmp_path, "stack"),
        rules=BusSettings(stream_max_mb=1),
    )
    # The operator sets up the bus (streams with these limits); the services' user may not.
    operator = Bus(
        server.url,
        trace.get_tracer_provider(),
        recorded_credentials(tmp_path, "operator"),
        rules=BusSettings(stream_max_mb=1),
    )
    try:
        await operator.connect(administer=True)
        await operator.close()
        await service.connect()
        yield {"url": server.url, "data": tmp_path, "service": service, "publishers": publishers}
    finally:
        await service.close()
        server.stop()


async def publisher(url: str, record: PublisherRecord) -> nats.NATS:
    return await nats.connect(
        url, user=record.name, password=record.password, allow_reconnect=False
    )


async def publish(nc: nats.NATS, subject: str, body: bytes) -> str | None:
    """Publish as an upstream system does; the server's refusal, if any."""
    try:
        await nc.jetstream().publish(subject, body, timeout=10)
    except nats.js.errors.APIError as err:
        return str(err.description)
    return None


def upload(org: str, i: int) -> bytes:
    return DocUploaded(org_id=org, name=f"junk-{i}.txt", content="junk").model_dump_json().encode()


async def test_a_publishers_flood_is_refused_past_its_backlog_and_others_still_publish(bus):
    """`flood` sends uploads faster than anyone processes them: the first ones are stored up
    to its backlog, every later one is refused with the server's reason, and `fair` (another
    org's publisher) still gets its upload in."""
    flood = await publisher(bus["url"], bus["publishers"]["flood"])
    fair = await publisher(bus["url"], bus["publishers"]["fair"])
    try:
        refusals = [await publish(flood, "doc.uploaded", upload("org-a", i)) for i in range(1500)]
        assert await publish(fair, "doc.uploaded", upload("org-b", 0)) is None
    finally:
        await flood.close()
        await fair.close()
    accepted = refusals.count(None)
    assert 0 < accepted < 1500
    info = await bus["service"].js.stream_info(UPSTREAM)
    assert accepted == info.config.max_msgs_per_subject
    assert refusals[:accepted] == [None] * accepted
    assert set(refusals[accepted:]) == {"maximum messages per subject exceeded"}
    assert info.state.messages == accepted + 1


async def test_the_publishers_stream_stays_within_its_bytes_and_refuses_oversized_events(bus):
    """Large events fill the publishers' stream up to its byte limit (1 MiB here) and no
    further: later ones are refused, what was stored stays. An event too large to be
    dead-lettered with its reason is refused outright."""
    fair = await publisher(bus["url"], bus["publishers"]["fair"])
    text = "y" * (64 * 1024)
    try:
        refusals = [
            await publish(
                fair,
                "ocr.done",
                OcrDone(org_id="org-b", document_id=f"d{i}", text=text).model_dump_json().encode(),
            )
            for i in range(40)
        ]
        oversized = DocUploaded(
            org_id="org-b", name="big.txt", content="z" * (fair.max_payload - 1024)
        )
        too_big = await publish(fair, "doc.uploaded", oversized.model_dump_json().encode())
    finally:
        await fair.close()
    stored = refusals.count(None)
    assert 0 < stored < 40
    info = await bus["service"].js.stream_info(UPSTREAM)
    assert info.config.max_bytes == MIB and info.state.bytes <= MIB
    assert info.state.messages == stored
    assert set(refusals[stored:]) == {"maximum bytes exceeded"}
    assert too_big == "message size exceeds maximum allowed"


async def test_a_flood_of_dead_letters_evicts_only_its_own_org_and_subject(bus):
    """Dead letters are kept per org and original subject up to a count, oldest out first:
    org-a's flood of them keeps the newest of org-a's, and org-b's one dead letter, written
    before the flood, is still there."""
    ingest = await nats.connect(
        bus["url"],
        user="ingest",
        password=_password(bus["data"], "ingest"),
        inbox_prefix="_INBOX.ingest",
        allow_reconnect=False,
    )
    js = ingest.jetstream()
    try:
        await js.publish("dlq.org-b.doc.uploaded", b'{"org_id": "org-b"}', stream=DEAD_LETTERS)
        flood = "dlq.org-a.doc.uploaded.upstream.org-a.flood"
        for i in range(1100):
            await js.publish(flood, json.dumps({"i": i}).encode(), stream=DEAD_LETTERS)
        info = await js.stream_info(DEAD_LETTERS, subjects_filter="dlq.>")
        oldest = await js.get_msg(DEAD_LETTERS, seq=1, subject=flood, next=True)
    finally:
        await ingest.close()
    kept = info.state.subjects or {}
    assert kept["dlq.org-b.doc.uploaded"] == 1
    assert 0 < kept[flood] == info.config.max_msgs_per_subject < 1100
    assert json.loads(oldest.data) == {"i": 1100 - kept[flood]}
    assert info.config.max_bytes == MIB and info.state.bytes <= MIB


def _password(data: Path, role: str) -> str:
    creds = recorded_credentials(data, role)
    assert creds is not None
    return creds.password
