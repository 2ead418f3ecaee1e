"""The private nats-server's store across the change to credentials: what a server without
accounts stored is found, unchanged, by the server of `kbmesh up` with them."""

from __future__ import annotations

import nats

from services.common.busauth import ACCOUNT, local_accounts, local_credentials
from services.common.natsproc import NatsServer


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
