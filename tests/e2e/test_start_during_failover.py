"""A service that starts while the NATS cluster fails over waits for JetStream instead of
exiting: it reports "starting" meanwhile and comes up, and works, once JetStream answers.

Three real nats-server processes on loopback and `kbmesh serve` processes, as in
test_nats_cluster.py. Two of the three nodes are killed while the services start (a node
down and another restarting, the case the cluster section of docs/operations.md names), so
JetStream has no majority and every API call of a start times out, however fast the
machine; then both come back.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.cluster import NatsCluster, jetstream_ready, upload
from tests.support.procs import (
    Proc,
    free_port,
    kbmesh_env,
    wait_for_line,
    wait_ready,
    wait_started,
    wait_until,
)

DOCUMENTS = 12


# With the three-node cluster test (`make test-slow`): it kills nodes at a moment taken from a
# process's log, which a machine under other load can miss.
@pytest.mark.slow
def test_services_started_while_jetstream_has_no_majority_wait_and_then_index(tmp_path):
    """`serve embed search` loses JetStream's majority right after it connected (while it
    loads its model, before its consumers exist) and a gateway is started while it is lost:
    neither exits; the gateway's /readyz answers 503 "starting" (its API 503 with
    Retry-After); once the nodes are back both become ready, and uploaded documents are
    indexed and found."""
    with NatsCluster(tmp_path / "cluster") as cluster:
        wait_until(
            lambda: asyncio.run(jetstream_ready(cluster.url)), 60, "the JetStream meta leader"
        )
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        env = kbmesh_env(
            KBMESH_NATS_URL=cluster.url,
            KBMESH_BUS__REPLICAS="3",
            KBMESH_DATA_DIR=str(tmp_path / "data"),
            KBMESH_PORT=str(port),
        )
        procs = {
            "ingest": Proc(["serve", "ingest"], tmp_path / "ingest.log", env),
            "embed": Proc(["serve", "embed", "search"], tmp_path / "embed.log", env),
        }
        try:
            # Connected, streams declared with three replicas: now it loads the model.
            wait_for_line(procs["embed"], "kbmesh embed search on ")
            down = cluster.nodes[:2]
            for node in down:
                node.kill9()
            procs["gateway"] = Proc(["serve", "gateway"], tmp_path / "gateway.log", env)

            def starting() -> bool:
                for name in ("embed", "gateway"):
                    if procs[name].proc.poll() is not None:
                        raise AssertionError(f"{name} exited:\n{procs[name].output()[-3000:]}")
                try:
                    r = httpx.get(f"{base}/readyz", timeout=2)
                except httpx.TransportError:
                    return False
                assert r.status_code == 503, r.text
                return r.json()["status"] == "starting"

            wait_until(starting, 60, "/readyz to say starting while JetStream has no majority")
            # Meanwhile the API says to come back, as it does while NATS is away.
            r = httpx.get(f"{base}/v1/kbs", timeout=5)
            assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
            assert r.headers["content-type"] == "application/problem+json"
            assert r.json()["error_type"] == "Unavailable"
            wait_for_line(procs["embed"], "start_waiting")
            assert procs["gateway"].proc.poll() is None
            for node in down:
                node.start()

            wait_ready(base, procs["gateway"], timeout=180)
            wait_started(procs["embed"], "embed search", timeout=180)
            wait_started(procs["ingest"], "ingest", timeout=180)
            statuses: list[int] = []
            with httpx.Client(base_url=base, timeout=30) as client:
                for i in range(DOCUMENTS):
                    body = {
                        "document_id": f"doc-{i:02d}",
                        "name": f"note-{i:02d}.txt",
                        "content": f"Note {i}: the raft algorithm elects a leader, term {i}.",
                    }
                    upload(client, body, statuses)

                def indexed() -> list[dict]:
                    r = client.get("/v1/kbs/default/documents", params={"limit": 100})
                    items = r.json()["items"] if r.status_code == 200 else []
                    done = [d for d in items if d["status"] == "complete"]
                    return done if len(done) == DOCUMENTS else []

                wait_until(indexed, 180, f"all {DOCUMENTS} documents indexed")
                # Searches are answered by the process that started during the failover.
                r = client.post("/v1/search", json={"query": "raft elects a leader"})
                assert r.status_code == 200, r.text
                hits = {h["document_id"] for h in r.json()["hits"]}
                assert hits and hits <= {f"doc-{i:02d}" for i in range(DOCUMENTS)}
        finally:
            for proc in procs.values():
                proc.stop()
