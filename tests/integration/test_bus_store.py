"""The private nats-server's store across the change to credentials: what a server without
accounts stored is found, unchanged, by the server of `kbmesh up` with them."""

from __future__ import annotations

import nats
import pytest

from services.common.bus.auth import ACCOUNT, local_accounts, local_credentials
from services.common.bus.nats_server import NatsServer


async def test_a_store_written_before_credentials_is_kept(tmp_path):
    data = tmp_path / "data"
    with NatsServer(data / "nats") as plain:
        nc = await nats.connect(plain.url)
        kv = await nc.jetstream().create_key_value(bucket="documents")
        await kv.put("acme.doc1", b"kept")
        await nc.close()
    with NatsServer(data / "nats", accounts=lambda: local_accounts(data)) as server:
        creds = local_credentials(data)["operator"]
        nc = await nats.connect(server.url, user=creds.user, password=creds.password)
        try:
            kv = await nc.jetstream().key_value("documents")
            assert (await kv.get("acme.doc1")).value == b"kept"
        finally:
            await nc.close()
    assert (data / "nats" / "jetstream" / ACCOUNT).is_dir()
    assert not (data / "nats" / "jetstream" / "$G").exists()


async def test_a_key_bucket_fed_from_elsewhere_is_refused(tmp_path):
    """Services may create the API-key bucket but not write it; one created with a source
    (keys copied in from a stream anyone could write) would plant keys, so a service
    refuses to start on it."""
    from nats.js.api import StreamConfig, StreamSource
    from opentelemetry import trace

    from services.common.bus.client import Bus

    with NatsServer(tmp_path / "nats") as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="planted", subjects=["planted.>"]))
        await js.add_stream(
            StreamConfig(
                name="KV_keys",
                subjects=["$KV.keys.>"],
                sources=[StreamSource(name="planted")],
                max_msgs_per_subject=1,
                allow_direct=True,
            )
        )
        await nc.close()
        bus = Bus(server.url, trace.get_tracer_provider())
        with pytest.raises(RuntimeError, match="API-key bucket"):
            await bus.connect()
        await bus.close()
