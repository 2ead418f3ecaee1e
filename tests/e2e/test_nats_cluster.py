"""kbmesh on a three-node NATS JetStream cluster, services in separate processes: 200
documents are ingested while one node is killed with `kill -9` and another restarted, and
every one of them ends indexed exactly once.

The services run as operators run them (`kbmesh serve`), each process given all three
node URLs; the stream, the dead-letter stream, the KV buckets and the object store are
declared with three replicas (`KBMESH_BUS__REPLICAS=3`). The vector store is the embedded
Qdrant Edge in the one process running embed and search: no Qdrant server exists on this
machine, and the server adapter's local stand-in (qdrant-client local mode) cannot be shared
between processes either. What the test is about — the bus surviving node failures without
losing or duplicating work — does not depend on the vector store.
"""

from __future__ import annotations

import asyncio

import httpx
import nats
import pytest

from services.common.messages.names import KV_BUCKETS, OBJECT_STORE
from services.common.store import Match
from services.common.store.base import Filter
from services.common.store.edge import EdgeStore
from tests.support.cluster import NatsCluster, jetstream_ready, upload
from tests.support.procs import (
    Proc,
    free_port,
    kbmesh_env,
    wait_ready,
    wait_started,
    wait_until,
)

pytestmark = pytest.mark.slow

DOCUMENTS = 200
TOPICS = (
    "glacier ice flows downhill under its own weight and carves valleys",
    "espresso is brewed by forcing hot water through finely ground coffee",
    "the raft algorithm elects a leader to replicate a log across servers",
    "tidal forces of the moon raise two bulges in the oceans of the earth",
)


def document(i: int) -> dict[str, str]:
    topic = TOPICS[i % len(TOPICS)]
    text = f"Note {i}. {topic}. " + " ".join(f"Remark {i}.{j} on {topic}." for j in range(12))
    return {"document_id": f"doc-{i:03d}", "name": f"note-{i:03d}.txt", "content": text}


async def replicas(url: str) -> dict[str, int]:
    nc = await nats.connect(url.split(","))
    try:
        js = nc.jetstream()
        names = ["KBMESH", "KBMESH_UPSTREAM", "KBMESH_DLQ", f"OBJ_{OBJECT_STORE}"] + [
            f"KV_{b}" for b in KV_BUCKETS
        ]
        return {n: (await js.stream_info(n)).config.num_replicas for n in names}
    finally:
        await nc.close()


def test_two_hundred_documents_survive_a_killed_and_a_restarted_node(tmp_path):
    with NatsCluster(tmp_path / "cluster") as cluster:
        wait_until(
            lambda: asyncio.run(jetstream_ready(cluster.url)), 60, "the JetStream meta leader"
        )
        port = free_port()
        env = kbmesh_env(
            KBMESH_NATS_URL=cluster.url,
            KBMESH_BUS__REPLICAS="3",
            KBMESH_DATA_DIR=str(tmp_path / "data"),
            KBMESH_PORT=str(port),
        )
        procs = {
            "ingest": Proc(["serve", "ingest"], tmp_path / "ingest.log", env),
            "embed": Proc(["serve", "embed", "search"], tmp_path / "embed.log", env),
            "gateway": Proc(["serve", "gateway"], tmp_path / "gateway.log", env),
        }
        base = f"http://127.0.0.1:{port}"
        statuses: list[int] = []
        try:
            # Every service consuming before the first node dies (a start during a failover
            # is test_start_during_failover.py's).
            wait_ready(base, procs["gateway"])
            wait_started(procs["ingest"], "ingest")
            wait_started(procs["embed"], "embed search")
            assert set(asyncio.run(replicas(cluster.url)).values()) == {3}
            killed, restarted = cluster.nodes[0], cluster.nodes[1]
            with httpx.Client(base_url=base, timeout=30) as client:
                for i in range(DOCUMENTS):
                    if i == 60:
                        killed.kill9()
                    if i == 120:
                        restarted.restart()
                    upload(client, document(i), statuses)
                killed.start()

                def complete() -> list[dict]:
                    try:
                        r = client.get("/v1/kbs/default/documents", params={"limit": 500})
                    except httpx.TransportError:
                        return []
                    if r.status_code != 200:
                        return []
                    items = r.json()["items"]
                    done = [d for d in items if d["status"] == "complete"]
                    return items if len(done) == DOCUMENTS else []

                items = wait_until(complete, 300, f"all {DOCUMENTS} documents indexed")
            assert sorted(d["document_id"] for d in items) == [
                f"doc-{i:03d}" for i in range(DOCUMENTS)
            ]
            chunk_counts = {d["document_id"]: d["chunk_count"] for d in items}
            assert all(n >= 1 for n in chunk_counts.values())
        finally:
            for proc in procs.values():
                proc.stop()
        logs = {name: proc.output() for name, proc in procs.items()}

    async def count_points() -> tuple[dict[str, int], int]:
        store = EdgeStore(tmp_path / "data" / "shards")
        try:
            per_doc = {
                doc: await store.count("kb_default", Filter(must=(Match("document_id", doc),)))
                for doc in chunk_counts
            }
            return per_doc, await store.count("kb_default")
        finally:
            await store.close()

    per_doc, total = asyncio.run(count_points())
    assert per_doc == chunk_counts, "a document indexed more or less than once"
    assert total == sum(chunk_counts.values()), "orphan points left behind"
    assert 500 not in statuses, logs["gateway"][-3000:]
    print(f"upload answers: {sorted(set(statuses))}, {statuses.count(503)} x 503")
