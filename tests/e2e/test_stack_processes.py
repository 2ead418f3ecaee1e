"""kbmesh as operators run it: `kbmesh up` in one process, and the services split across
processes on one nats-server — driven only through REST."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import pytest

from services.common.bus.auth import Credentials, new_password, server_accounts
from services.common.bus.nats_server import NatsServer
from services.common.store import Match
from services.common.store.base import Filter
from services.common.store.edge import EdgeStore
from tests.support.corpus import DOCS, PARAPHRASES
from tests.support.procs import (
    KBMESH,
    ROOT,
    Proc,
    free_port,
    kbmesh_env,
    wait_ready,
    wait_until,
)


def upload_and_search(base: str) -> dict[str, str]:
    ids = {}
    with httpx.Client(base_url=base, timeout=120) as client:
        for name, text in DOCS.items():
            r = client.post(
                "/v1/kbs/default/documents",
                params={"wait": "true"},
                json={"name": name, "content": text, "mime_type": "text/markdown"},
            )
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "complete"
            ids[name] = r.json()["document_id"]
        assert_paraphrases_found(client, ids)
    return ids


def assert_paraphrases_found(client: httpx.Client, ids: dict[str, str]) -> None:
    for name, query in PARAPHRASES.items():
        r = client.post("/v1/search", json={"query": query})
        assert r.status_code == 200, r.text
        top = r.json()["hits"][0]
        assert top["document_id"] == ids[name] and top["content"] and top["score"] is not None


def test_up_indexes_searches_and_survives_a_restart(tmp_path):
    """`kbmesh up` as a subprocess: uploads with wait=true, paraphrases find their
    documents; after SIGTERM (nats-server stopped too) and a restart, the same searches
    answer and nothing is re-indexed."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["up", "--data-dir", str(tmp_path / "data"), "--port", str(port)]
    first = Proc(args, tmp_path / "first.log", kbmesh_env())
    try:
        wait_ready(base, first)
        ids = upload_and_search(base)
        listing = httpx.get(f"{base}/v1/kbs/default/documents").json()["items"]
    finally:
        assert first.stop() == 0, first.output()[-3000:]
    assert "kbmesh stopped" in first.output()
    survivors = subprocess.run(
        ["pgrep", "-f", f"nats-server -c {tmp_path}"], check=False, capture_output=True, text=True
    ).stdout
    assert not survivors.strip(), "nats-server outlived kbmesh up"

    second = Proc(args, tmp_path / "second.log", kbmesh_env())
    try:
        wait_ready(base, second)
        with httpx.Client(base_url=base, timeout=60) as client:
            assert_paraphrases_found(client, ids)
            again = client.get("/v1/kbs/default/documents").json()["items"]
        assert [d["indexed_at"] for d in again] == [d["indexed_at"] for d in listing]
    finally:
        second.stop()
    assert "indexed org_id" not in second.output()


# Each process connects as its own NATS user with the least permissions its services need
# (services/common/bus/auth.py): what one of them misses shows up here as a failed flow.
PROCESS_ROLES = {"ingest": "ingest", "embed": "embed+search", "gateway": "gateway"}


def process_users() -> dict[str, Credentials]:
    return {
        role: Credentials(role.replace("+", "-"), new_password())
        for role in ("operator", *PROCESS_ROLES.values())
    }


def as_user(env: dict[str, str], creds: Credentials) -> dict[str, str]:
    return {**env, "KBMESH_NATS__USER": creds.user, "KBMESH_NATS__PASSWORD": creds.password}


def bus_setup(env: dict[str, str], creds: Credentials) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KBMESH, "bus", "setup"],
        cwd=ROOT,
        env=as_user(env, creds),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_services_start_only_on_a_bus_the_operator_set_up(tmp_path):
    """A service's NATS user may not create streams, buckets or consumers: `kbmesh serve`
    on a bus nobody set up exits at once, naming the step to run; `kbmesh bus setup` as a
    service's user is refused; as the operator it sets up everything, and then the service
    starts."""
    users = process_users()
    with NatsServer(tmp_path / "nats", accounts=lambda: server_accounts(users)) as nats:
        env = kbmesh_env(KBMESH_NATS_URL=nats.url, KBMESH_DATA_DIR=str(tmp_path / "data"))
        early = subprocess.run(
            [*KBMESH, "serve", "ingest"],
            cwd=ROOT,
            env=as_user(env, users["ingest"]),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert early.returncode == 1, early.stdout + early.stderr
        assert "kbmesh bus setup" in early.stderr, early.stderr
        refused = bus_setup(env, users["ingest"])
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "may not set up the bus" in refused.stderr, refused.stderr
        done = bus_setup(env, users["operator"])
        assert done.returncode == 0, done.stderr
        ingest = Proc(["serve", "ingest"], tmp_path / "ingest.log", as_user(env, users["ingest"]))
        try:
            wait_until(lambda: "kbmesh ingest on" in ingest.output(), 120, "ingest started")
            assert ingest.proc.poll() is None, ingest.output()[-3000:]
        finally:
            assert ingest.stop() == 0, ingest.output()[-3000:]


@pytest.fixture
def split_stack(tmp_path):
    """nats-server with one user per process, set up by the operator (`kbmesh bus setup`),
    + `serve ingest` + `serve embed search` + `serve gateway`."""
    users = process_users()
    nats = NatsServer(tmp_path / "nats", accounts=lambda: server_accounts(users)).start()
    port = free_port()
    env = kbmesh_env(
        KBMESH_NATS_URL=nats.url,
        KBMESH_DATA_DIR=str(tmp_path / "data"),
        KBMESH_PORT=str(port),
    )
    setup = bus_setup(env, users["operator"])
    assert setup.returncode == 0, setup.stderr
    metrics = {"ingest": free_port(), "embed": free_port()}
    envs = {
        name: {
            **env,
            "KBMESH_NATS__USER": users[role].user,
            "KBMESH_NATS__PASSWORD": users[role].password,
            **({"KBMESH_METRICS_PORT": str(metrics[name])} if name in metrics else {}),
        }
        for name, role in PROCESS_ROLES.items()
    }
    procs = {
        "ingest": Proc(["serve", "ingest"], tmp_path / "ingest.log", envs["ingest"]),
        "embed": Proc(["serve", "embed", "search"], tmp_path / "embed.log", envs["embed"]),
        "gateway": Proc(["serve", "gateway"], tmp_path / "gateway.log", envs["gateway"]),
    }
    stack = {
        "base": f"http://127.0.0.1:{port}",
        "metrics": metrics,
        "procs": procs,
        "env": envs["embed"],
        "tmp": tmp_path,
        "nats": nats,
    }
    try:
        wait_ready(stack["base"], procs["gateway"])
        yield stack
    finally:
        for proc in stack["procs"].values():
            proc.stop()
        nats.stop()


def test_split_processes_index_and_search(split_stack):
    """The same flow with ingest, embed+search and gateway in three processes; each process
    counts its own part of the work in its own metrics."""
    upload_and_search(split_stack["base"])
    embed = scrape(f"http://127.0.0.1:{split_stack['metrics']['embed']}/metrics")
    assert embed["kbmesh_documents_indexed_total"] == len(DOCS)
    assert embed["kbmesh_search_requests_total"] == len(PARAPHRASES)
    assert embed["kbmesh_chunks_embedded_total"] >= len(DOCS)
    ingest = scrape(f"http://127.0.0.1:{split_stack['metrics']['ingest']}/metrics")
    assert ingest["kbmesh_chunks_embedded_total"] == 0
    assert "kbmesh_dead_letters" in ingest
    gateway = scrape(f"{split_stack['base']}/metrics")
    assert gateway["kbmesh_search_requests_total"] == 0
    assert gateway['kbmesh_pending_messages{consumer="embed-kb-index"}'] == 0


def scrape(url: str) -> dict[str, float]:
    """A /metrics page read with Prometheus's parser: sample (with labels) → value."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, r.text
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_kill9_embed_mid_indexing_loses_nothing_and_duplicates_nothing(split_stack):
    """Kill -9 the embed process while 50 documents are being indexed, start it again:
    every document ends indexed exactly once — points per document equal its chunk count,
    no orphans — and none is lost."""
    base, procs = split_stack["base"], split_stack["procs"]
    paragraph = (
        "Section {i}.{j}: the reactor coolant loop number {i} carries heat from the core "
        "to the steam generator, where feedwater boils and drives turbine stage {j}. "
    )
    with httpx.Client(base_url=base, timeout=60) as client:
        # Warm-up: the embed process has loaded its model once this answers.
        client.post(
            "/v1/kbs/default/documents",
            params={"wait": "true"},
            json={"name": "warmup", "content": "warm up"},
        ).raise_for_status()
        ids = []
        for i in range(50):
            text = "".join(paragraph.format(i=i, j=j) for j in range(12))
            r = client.post(
                "/v1/kbs/default/documents", json={"name": f"doc-{i}.txt", "content": text}
            )
            assert r.status_code == 202, r.text
            ids.append(r.json()["document_id"])

        def indexed() -> int:
            items = client.get("/v1/kbs/default/documents", params={"limit": 500}).json()["items"]
            return sum(1 for d in items if d["status"] == "complete")

        wait_until(lambda: indexed() >= 8, 300, "some documents indexed")
        procs["embed"].kill9()
        assert indexed() < 51, "everything was indexed before the kill; nothing was tested"
        procs["embed"] = Proc(
            ["serve", "embed", "search"], split_stack["tmp"] / "embed2.log", split_stack["env"]
        )
        wait_until(lambda: indexed() == 51, 600, "all 51 documents indexed")
        items = client.get("/v1/kbs/default/documents", params={"limit": 500}).json()["items"]
    chunk_counts = {d["document_id"]: d["chunk_count"] for d in items}
    assert set(ids) <= set(chunk_counts)
    procs["embed"].stop()

    async def count_points() -> tuple[dict[str, int], int]:
        store = EdgeStore(split_stack["tmp"] / "data" / "shards")
        try:
            per_doc = {
                doc: await store.count("kb_default", Filter(must=(Match("document_id", doc),)))
                for doc in chunk_counts
            }
            return per_doc, await store.count("kb_default")
        finally:
            await store.close()

    per_doc, total = asyncio.run(count_points())
    assert per_doc == chunk_counts
    assert total == sum(chunk_counts.values()), "orphan points left behind"
    assert all(per_doc[d] > 1 for d in ids)
