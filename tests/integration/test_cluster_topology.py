"""On a NATS cluster kbmesh keeps every stream and bucket at `KBMESH_BUS__REPLICAS` copies,
also when the number is raised after the first start. Three real nats-server processes."""

from __future__ import annotations

import asyncio

import nats

from services.common.bus.client import declare_topology
from services.common.messages.names import KV_BUCKETS, OBJECT_STORE
from services.common.settings import BusSettings
from tests.support.cluster import NatsCluster, jetstream_ready
from tests.support.domain import wait_until

STREAMS = ["KBMESH", "KBMESH_UPSTREAM", "KBMESH_DLQ", f"OBJ_{OBJECT_STORE}"] + [
    f"KV_{b}" for b in KV_BUCKETS
]


async def test_replicas_are_raised_on_an_existing_deployment(tmp_path):
    """Declared with one replica first (a deployment from before), then with three: every
    stream, KV bucket and the object store ends with three, and the data stays."""
    with NatsCluster(tmp_path) as cluster:

        async def ready() -> bool:
            return await jetstream_ready(cluster.url)

        await wait_until(ready, timeout=60, interval=0.2, what="the JetStream meta leader")
        nc = await nats.connect(cluster.url.split(","))
        try:
            js = nc.jetstream()
            await declare_topology(js, BusSettings(replicas=1))
            kv = await js.key_value("kbs")
            await kv.put("kept", b"1")
            await declare_topology(js, BusSettings(replicas=3))
            infos = await asyncio.gather(*(js.stream_info(name) for name in STREAMS))
            assert {i.config.name: i.config.num_replicas for i in infos} == dict.fromkeys(
                STREAMS, 3
            )
            assert (await kv.get("kept")).value == b"1"
        finally:
            await nc.close()
