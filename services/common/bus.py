"""Bus wiring: the broker, streams, KV buckets, publishing with de-duplication, and the
consumer wrapper that turns every handler into an at-least-once, dead-lettering one.

Delivery rules (one place, every service):
- a message that does not parse as its event model goes to `dlq.<subject>` at once;
- a permanent error (`InvalidInput`) goes to the dead-letter subject at once;
- any other error is retried with backoff; after `max_deliver` tries it is dead-lettered;
- success acks. The dead letter keeps the original bytes and headers, with the reason in
  `Kbmesh-*` headers, so it can be replayed as is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from faststream.middlewares import AckPolicy
from faststream.nats import JStream, NatsBroker, NatsRouter, PullSub
from faststream.nats.annotations import NatsMessage
from faststream.nats.opentelemetry import NatsTelemetryMiddleware
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, StorageType, StreamConfig
from nats.js.errors import BadRequestError
from opentelemetry.trace import TracerProvider
from pydantic import BaseModel, ValidationError

from services.common.errors import InvalidInput, KbmeshError
from services.common.events import (
    DLQ_STREAM,
    EVENT_MODELS,
    STREAM,
    STREAM_SUBJECTS,
    Event,
    dlq_subject,
)
from services.common.settings import BusSettings, Settings

log = logging.getLogger("kbmesh.bus")

E = TypeVar("E", bound=Event)
Handler = Callable[[Any], Awaitable[None]]
FailureHook = Callable[[Any, Exception], Awaitable[None]]

KV_BUCKETS = ("kbs", "documents", "index", "keys", "prompts")
OBJECT_STORE = "texts"
# Declared by `Bus.start()`; subscribers only reference it.
JSTREAM = JStream(STREAM, subjects=STREAM_SUBJECTS, declare=False)


class Bus:
    """One process's link to NATS: the FastStream broker for events and requests, and a
    nats-py JetStream context for the registries (KV) and the `texts` object store."""

    def __init__(self, settings: Settings, url: str, tracer_provider: TracerProvider) -> None:
        self.settings = settings
        self.url = url
        self.broker = NatsBroker(
            url,
            middlewares=[NatsTelemetryMiddleware(tracer_provider=tracer_provider)],
            logger=logging.getLogger("kbmesh.faststream"),
        )
        self.nc: nats.NATS | None = None
        self._js: JetStreamContext | None = None

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise RuntimeError("bus not connected")
        return self._js

    async def connect(self) -> None:
        """Connect and declare streams, buckets and the object store (idempotent)."""
        self.nc = await nats.connect(self.url, name="kbmesh", max_reconnect_attempts=-1)
        self._js = self.nc.jetstream()
        await declare_topology(self._js, self.settings.bus)
        await self.broker.connect()

    async def start(self) -> None:
        """Start consuming (after every router was included)."""
        await self.broker.start()

    async def close(self) -> None:
        await self.broker.stop()
        if self.nc is not None:
            await self.nc.drain()
            self.nc = None

    async def publish(self, subject: str, event: Event) -> None:
        """Durable publish: waits for the stream's ack; `event_id` de-duplicates retries."""
        await self.broker.publish(
            event.model_dump_json(),
            subject,
            headers={"Nats-Msg-Id": event.event_id, "content-type": "application/json"},
            stream=STREAM,
            timeout=10.0,
        )

    async def request(self, subject: str, payload: BaseModel, timeout: float) -> dict[str, Any]:
        reply = await self.broker.request(payload.model_dump_json(), subject, timeout=timeout)
        body: dict[str, Any] = json.loads(reply.body)
        return body


async def declare_topology(js: JetStreamContext, bus: BusSettings) -> None:
    stream = StreamConfig(
        name=STREAM,
        subjects=STREAM_SUBJECTS,
        storage=StorageType.FILE,
        max_age=bus.stream_max_age_days * 86400,
        duplicate_window=120.0,
        num_replicas=bus.replicas,
    )
    dlq = StreamConfig(
        name=DLQ_STREAM,
        subjects=["dlq.>"],
        storage=StorageType.FILE,
        max_age=30 * 86400,
        num_replicas=bus.replicas,
    )
    for config in (stream, dlq):
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)
    for bucket in KV_BUCKETS:
        await js.create_key_value(bucket=bucket, history=1, replicas=bus.replicas)
    await js.create_object_store(OBJECT_STORE, replicas=bus.replicas)


async def dead_letter(bus: Bus, msg: Any, reason: str, error_type: str) -> None:
    """Publish the original message to `dlq.<subject>` with the reason in headers."""
    headers = {k: v for k, v in (msg.headers or {}).items() if k != "Nats-Msg-Id"}
    meta = msg.metadata
    headers.update(
        {
            "Kbmesh-Original-Subject": msg.subject,
            "Kbmesh-Error": reason[:2000],
            "Kbmesh-Error-Type": error_type,
            "Kbmesh-Delivered": str(meta.num_delivered),
            "Nats-Msg-Id": f"dlq-{meta.stream}-{meta.sequence.stream}",
        }
    )
    await bus.js.publish(dlq_subject(msg.subject), msg.data, headers=headers, stream=DLQ_STREAM)
    log.warning(
        "dead_letter subject=%s error_type=%s reason=%s", msg.subject, error_type, reason[:300]
    )


def consume(
    router: NatsRouter,
    bus: Bus,
    subject: str,
    durable: str,
    handler: Handler,
    *,
    on_failure: FailureHook | None = None,
    max_workers: int = 1,
) -> None:
    """Subscribe `handler(event)` to `subject` with a durable pull consumer named `durable`.

    `handler` must be idempotent: any message may arrive more than once.
    `on_failure(event, error)` runs before a parsed message is dead-lettered, so the owner
    can record why (e.g. mark the document failed).
    """
    model = EVENT_MODELS[subject]
    settings = bus.settings.bus

    async def _on_message(msg: NatsMessage) -> None:
        raw = msg.raw_message
        delivered = raw.metadata.num_delivered
        try:
            event = model.model_validate_json(raw.data)
        except ValidationError as err:
            await dead_letter(bus, raw, _validation_reason(err), "ValidationError")
            await msg.reject()
            return
        heartbeat = asyncio.create_task(_keep_alive(msg, settings.ack_wait_seconds))
        try:
            await handler(event)
        except Exception as err:
            permanent = isinstance(err, KbmeshError) and not err.retryable
            if permanent or delivered >= settings.max_deliver:
                if on_failure is not None:
                    with contextlib.suppress(Exception):
                        await on_failure(event, err)
                error_type = err.error_type if isinstance(err, KbmeshError) else type(err).__name__
                await dead_letter(bus, raw, str(err) or repr(err), error_type)
                await msg.reject()
            else:
                delay = settings.backoff_seconds[min(delivered, len(settings.backoff_seconds)) - 1]
                log.warning(
                    "retry subject=%s delivered=%d delay=%.1f error=%r",
                    subject,
                    delivered,
                    delay,
                    err,
                )
                await msg.nack(delay=delay)
        else:
            await msg.ack()
        finally:
            heartbeat.cancel()

    kwargs: dict[str, Any] = {}
    if max_workers > 1:
        kwargs["max_workers"] = max_workers
    router.subscriber(
        subject,
        stream=JSTREAM,
        durable=durable,
        pull_sub=PullSub(batch_size=max(1, max_workers), timeout=2.0),
        ack_policy=AckPolicy.MANUAL,
        config=ConsumerConfig(
            ack_wait=settings.ack_wait_seconds,
            # JetStream's own limit is a backstop above ours: we dead-letter first.
            max_deliver=settings.max_deliver + 2,
        ),
        **kwargs,
    )(_on_message)


async def _keep_alive(msg: Any, ack_wait: float) -> None:
    """Long work (embedding a big document) must not be redelivered to another worker."""
    while True:
        await asyncio.sleep(max(ack_wait / 3, 1.0))
        with contextlib.suppress(Exception):
            await msg.in_progress()


def _validation_reason(err: ValidationError) -> str:
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}" for e in err.errors()]
    return "malformed event: " + "; ".join(parts)


__all__ = [
    "JSTREAM",
    "KV_BUCKETS",
    "OBJECT_STORE",
    "Bus",
    "InvalidInput",
    "consume",
    "dead_letter",
]
