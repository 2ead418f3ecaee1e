"""Redelivery settings reach consumers that already exist: a durable consumer keeps the
configuration it was created with unless a start applies the current one."""

from __future__ import annotations

import nats
from nats.js.api import AckPolicy, ConsumerConfig

from services.common.bus.client import ACK_WAIT_SECONDS, declare_topology
from services.common.bus.nats_server import NatsServer
from services.common.messages.names import STREAM, Subject
from services.common.settings import BusSettings
from tests.conftest import running_stack


async def test_a_consumer_from_an_older_version_gets_the_short_ack_wait(tmp_path, embedders):
    """The embed consumer created with the old two-minute ack wait is switched to the
    configured one when the stack starts, so a crash no longer hides work for minutes."""
    with NatsServer(tmp_path / "nats") as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await declare_topology(js, BusSettings())
        await js.add_consumer(
            STREAM,
            ConsumerConfig(
                durable_name="embed-kb-index",
                filter_subject=Subject.KB_INDEX,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=120,
                max_deliver=7,
            ),
        )
        await nc.close()
        async with running_stack(tmp_path, nats_url=server.url, embedders=embedders) as (rt, _):
            info = await rt.bus.js.consumer_info(STREAM, "embed-kb-index")
            assert info.config.ack_wait == ACK_WAIT_SECONDS == 10
            assert info.config.max_deliver == rt.settings.bus.max_deliver + 2
