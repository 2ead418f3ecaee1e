"""Bus wiring: the broker, streams, KV buckets, publishing with de-duplication, and the
consumer wrapper that turns every handler into an at-least-once, dead-lettering one.

Delivery rules (one place, every service):
- a message that does not parse as its event model, for whatever reason (invalid JSON,
  nesting too deep for any decoder, wrong fields), goes to `dlq.<subject>` at once: the
  framework hands the raw bytes over undecoded, so nothing can fail before this wrapper;
- a permanent error (`InvalidInput`) goes to the dead-letter subject at once;
- any other error is retried with backoff; after `max_deliver` tries it is dead-lettered;
- success acks. The dead letter keeps the original bytes and headers, with the reason in
  `Kbmesh-*` headers, so it can be replayed as is.
- while a handler works it reports progress every third of `ack_wait`, so the ack wait
  can be short: work of a process that died is redelivered within `ack_wait` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from faststream.middlewares import AckPolicy
from faststream.nats import JStream, NatsBroker, NatsRouter, PullSub
from faststream.nats.annotations import NatsMessage
from faststream.nats.opentelemetry import NatsTelemetryMiddleware
from faststream.nats.security import NatsSecurity, NatsUserPassword
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError
from opentelemetry.trace import TracerProvider
from pydantic import BaseModel, ValidationError

from services.common.bus import replies
from services.common.bus.audit import declare_audit_stream
from services.common.bus.auth import (
    CURRENT_PUBLISHER,
    UPSTREAM_STATUS,
    Credentials,
    inbox_prefix,
    publisher_of,
    status_subject,
    upstream_filter,
)
from services.common.domain.errors import InvalidInput, KbmeshError, Transient
from services.common.messages.events import (
    DLQ_STREAM,
    EVENT_MODELS,
    STREAM,
    STREAM_SUBJECTS,
    Event,
    dlq_subject,
)
from services.common.messages.names import KEYS_BUCKET, KV_BUCKETS, OBJECT_STORE
from services.common.settings import AuditSettings, BusSettings, NatsAuthSettings

log = logging.getLogger("kbmesh.bus")

E = TypeVar("E", bound=Event)
Handler = Callable[[Any], Awaitable[None]]
FailureHook = Callable[[Any, Exception], Awaitable[None]]

# What a call raises while NATS (or JetStream's quorum in a cluster) is away: transient, the
# caller answers 503 or retries.
BUS_UNAVAILABLE: tuple[type[Exception], ...] = (
    TimeoutError,  # nats-py's own TimeoutError derives from it
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoServersError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.errors.FlushTimeoutError,
    ServiceUnavailableError,
)
TOPOLOGY_RETRY_SECONDS = (0.5, 1.0, 2.0, 5.0)


def unavailable(err: BaseException) -> Transient:
    """What a caller is told when NATS (or JetStream's quorum) did not answer in time."""
    return Transient(
        f"the message bus is unavailable ({type(err).__name__}); retry in a few seconds"
    )


# Declared by `Bus.start()`; subscribers only reference it.
JSTREAM = JStream(STREAM, subjects=STREAM_SUBJECTS, declare=False)


def _tls_context(auth: NatsAuthSettings) -> ssl.SSLContext | None:
    if not (auth.tls_ca_file or auth.tls_cert_file):
        return None
    context = ssl.create_default_context(cafile=str(auth.tls_ca_file) if auth.tls_ca_file else None)
    if auth.tls_cert_file:
        context.load_cert_chain(
            str(auth.tls_cert_file), str(auth.tls_key_file) if auth.tls_key_file else None
        )
    return context


class Bus:
    """One process's link to NATS: the FastStream broker for events and requests, and a
    nats-py JetStream context for the registries (KV) and the `texts` object store.

    It connects as `credentials`, else as `KBMESH_NATS__USER`, else anonymously (a server
    without authorization: tests, a development NATS)."""

    def __init__(
        self,
        url: str,
        tracer_provider: TracerProvider,
        credentials: Credentials | None = None,
        *,
        rules: BusSettings | None = None,
        auth: NatsAuthSettings | None = None,
        audit: AuditSettings | None = None,
    ) -> None:
        # Delivery rules (redelivery, dead letters, retention), the NATS user and TLS, and
        # the audit stream's retention: the settings groups the bus reads, and no other.
        self.rules = rules or BusSettings()
        self._audit = audit or AuditSettings()
        self.url = url
        # A comma-separated list seeds the connection to a cluster; the client learns the other
        # members from the servers themselves and reconnects to any of them.
        self.servers = [u.strip() for u in url.split(",") if u.strip()]
        auth = auth or NatsAuthSettings()
        if credentials is None and auth.user:
            credentials = Credentials(auth.user, auth.password or "")
        self.user = credentials.user if credentials else None
        # Where this connection's replies arrive (pull subscriptions name it themselves).
        self.inbox = inbox_prefix(self.user) if self.user else "_INBOX"
        tls = _tls_context(auth)
        self._options: dict[str, Any] = {}
        security: NatsSecurity | None = NatsSecurity(ssl_context=tls) if tls else None
        if credentials is not None:
            self._options = {
                "user": credentials.user,
                "password": credentials.password,
                "inbox_prefix": self.inbox,
            }
            security = NatsUserPassword(credentials.user, credentials.password, ssl_context=tls)
        if tls is not None:
            self._options["tls"] = tls
        self.broker = NatsBroker(
            self.servers,
            # NATS may be away for any time (restarted, a cluster failing over): never give up.
            max_reconnect_attempts=-1,
            middlewares=[NatsTelemetryMiddleware(tracer_provider=tracer_provider)],
            logger=logging.getLogger("kbmesh.faststream"),
            security=security,
            inbox_prefix=self.inbox,
        )
        self.nc: nats.NATS | None = None
        self._js: JetStreamContext | None = None
        self.consumers: dict[str, ConsumerConfig] = {}  # durable name → settings we own
        self.responders: list[replies.Responder] = []  # request/reply, started with the rest
        self._tracer = tracer_provider.get_tracer("kbmesh.bus")

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise RuntimeError("bus not connected")
        return self._js

    async def connect(self) -> None:
        """Connect and declare streams, buckets and the object store (idempotent)."""
        self.nc = await nats.connect(
            self.servers, name="kbmesh", max_reconnect_attempts=-1, **self._options
        )
        self._js = self.nc.jetstream()
        attempt = 0
        while True:
            try:
                await declare_topology(self._js, self.rules, self._audit)
                break
            except BUS_UNAVAILABLE as err:
                # A cluster that is still electing its JetStream leader, or a server that
                # is restarting: wait for it like for the connection itself.
                delay = TOPOLOGY_RETRY_SECONDS[min(attempt, len(TOPOLOGY_RETRY_SECONDS) - 1)]
                attempt += 1
                log.warning("jetstream_unavailable error=%r retry_in=%.1f", err, delay)
                await asyncio.sleep(delay)
        await self.broker.connect()

    async def start(self) -> None:
        """Start consuming and answering (after every router and responder was added)."""
        await self._update_consumers()
        await self.broker.start()
        for responder in self.responders:
            await responder.start(self._connection(), self._tracer)

    async def _update_consumers(self) -> None:
        """Durable consumers outlive processes and binding to one keeps its old settings:
        apply today's ack wait and delivery limit to those that exist already."""
        for durable, wanted in self.consumers.items():
            try:
                info = await self.js.consumer_info(STREAM, durable)
            except NotFoundError:
                continue  # created with these settings when the subscriber starts
            current = info.config
            if (current.ack_wait, current.max_deliver) != (wanted.ack_wait, wanted.max_deliver):
                await self.js.add_consumer(
                    STREAM, current.evolve(ack_wait=wanted.ack_wait, max_deliver=wanted.max_deliver)
                )

    async def close(self) -> None:
        for responder in self.responders:
            await responder.stop()
        await self.broker.stop()
        if self.nc is not None:
            await self.nc.drain()
            self.nc = None

    async def publish(self, subject: str, event: Event) -> None:
        """Durable publish: waits for the stream's ack; `event_id` de-duplicates retries.
        Status notifications are repeated, undurably, to the org's upstream publishers."""
        body = event.model_dump_json()
        await self.broker.publish(
            body,
            subject,
            headers={"Nats-Msg-Id": event.event_id, "content-type": "application/json"},
            stream=STREAM,
            timeout=10.0,
        )
        if subject in UPSTREAM_STATUS and self.nc is not None:
            await self.nc.publish(status_subject(event.org_id, subject), body.encode())

    async def request(self, subject: str, payload: BaseModel, timeout: float) -> dict[str, Any]:
        """Ask a `Responder` on `subject` (see replies.py) and decode its JSON reply."""
        body: dict[str, Any] = json.loads(await self.ask(subject, payload, timeout))
        return body

    async def ask(self, subject: str, payload: BaseModel, timeout: float) -> bytes:
        """Ask a `Responder` on `subject`: its reply as it came."""
        data = payload.model_dump_json().encode()
        return await replies.request(self._connection(), self._tracer, subject, data, timeout)

    def max_payload(self) -> int:
        """The largest message the connected server takes (a reply must fit in one)."""
        return self.nc.max_payload if self.nc is not None else replies.DEFAULT_MAX_PAYLOAD

    def _connection(self) -> nats.NATS:
        if self.nc is None:
            raise RuntimeError("bus not connected")
        return self.nc


async def declare_topology(
    js: JetStreamContext, bus: BusSettings, audit: AuditSettings | None = None
) -> None:
    audit = audit or AuditSettings()
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
    await declare_audit_stream(js, audit, bus.replicas)
    for bucket in KV_BUCKETS:
        if bucket == KEYS_BUCKET:
            with contextlib.suppress(NotFoundError):
                _check_key_bucket((await js.stream_info(f"KV_{bucket}")).config)
        try:
            await _set_replicas(js, f"KV_{bucket}", bus.replicas)
        except TimeoutError:
            if bucket != KEYS_BUCKET:
                raise
            # Only the operator's user may change the key bucket (services/common/bus/auth.py):
            # a service leaves it as it is, and the next `kbmesh keys` applies the change.
            log.warning("stream_replicas_unchanged stream=KV_%s reason=operator_only", bucket)
            continue
        await js.create_key_value(bucket=bucket, history=1, replicas=bus.replicas)
    await _set_replicas(js, f"OBJ_{OBJECT_STORE}", bus.replicas)
    await js.create_object_store(OBJECT_STORE, replicas=bus.replicas)


def _check_key_bucket(config: StreamConfig) -> None:
    """Every service may create the API-key bucket (empty), none may write it. A bucket that
    someone created fed from elsewhere (a mirror, sources, a subject transform) would let
    them plant keys: refuse to start on it."""
    fed = config.mirror or config.sources or config.subject_transform
    if fed or config.subjects != [f"$KV.{KEYS_BUCKET}.>"]:
        raise RuntimeError(
            f"the API-key bucket (stream KV_{KEYS_BUCKET}) is not a plain key-value bucket "
            "(mirror, sources, subject transform or foreign subjects): refusing to trust it; "
            "an operator must inspect and recreate it"
        )


async def _set_replicas(js: JetStreamContext, stream: str, replicas: int) -> None:
    """A bucket created with other replicas is changed in place (JetStream moves the data),
    so raising `KBMESH_BUS__REPLICAS` on a running cluster sticks; creating it again with a
    different configuration would be refused."""
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return
    if info.config.num_replicas != replicas:
        log.warning(
            "stream_replicas stream=%s from=%s to=%d", stream, info.config.num_replicas, replicas
        )
        await js.update_stream(info.config.evolve(num_replicas=replicas))


async def dead_letter(bus: Bus, msg: Any, reason: str, error_type: str) -> None:
    """Publish the original message to `dlq.<subject>` with the reason in headers."""
    headers = {k: v for k, v in (msg.headers or {}).items() if k != "Nats-Msg-Id"}
    meta = msg.metadata
    headers.update(
        {
            "Kbmesh-Original-Subject": msg.subject,
            # One header line: a line break in an error message would end the header.
            "Kbmesh-Error": " ".join(reason.split())[:2000],
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
    upstream: bool = False,
) -> None:
    """Subscribe `handler(event)` to `subject` with a durable pull consumer named `durable`.

    `handler` must be idempotent: any message may arrive more than once.
    `on_failure(event, error)` runs before a parsed message is dead-lettered, so the owner
    can record why (e.g. mark the document failed).
    With `upstream`, upstream publishers' `subject` is consumed too (durable
    `<durable>-upstream`): an event whose `org_id` is not its publisher's org is
    dead-lettered unread; while `handler` runs, `CURRENT_PUBLISHER` names the publisher.
    """
    model = EVENT_MODELS[subject]
    settings = bus.rules

    async def _on_message(msg: NatsMessage) -> None:
        raw = msg.raw_message
        delivered = raw.metadata.num_delivered
        try:
            event = model.model_validate_json(raw.data)
        except ValidationError as err:
            await dead_letter(bus, raw, _validation_reason(err), "ValidationError")
            await msg.reject()
            return
        except (RecursionError, ValueError, MemoryError) as err:
            # Whatever the body is, it will not parse next time either.
            await dead_letter(bus, raw, f"malformed event: {err!r}"[:500], "ValidationError")
            await msg.reject()
            return
        publisher = publisher_of(raw.subject)
        if publisher is not None and publisher.org_id != event.org_id:
            reason = (
                f"publisher {publisher.name!r} may publish for org {publisher.org_id!r} only, "
                f"not {event.org_id!r}"
            )
            await dead_letter(bus, raw, reason, "Forbidden")
            await msg.reject()
            return
        heartbeat = asyncio.create_task(_keep_alive(msg, settings.ack_wait_seconds))
        token = CURRENT_PUBLISHER.set(publisher)
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
            CURRENT_PUBLISHER.reset(token)
            heartbeat.cancel()

    kwargs: dict[str, Any] = {}
    if max_workers > 1:
        kwargs["max_workers"] = max_workers
    config = ConsumerConfig(
        ack_wait=settings.ack_wait_seconds,
        # JetStream's own limit is a backstop above ours: we dead-letter first.
        max_deliver=settings.max_deliver + 2,
    )
    subscriptions = [(subject, durable)]
    if upstream:
        subscriptions.append((upstream_filter(subject), f"{durable}-upstream"))
    for filter_subject, name in subscriptions:
        bus.consumers[name] = config
        router.subscriber(
            filter_subject,
            stream=JSTREAM,
            durable=name,
            # One message per pull: a fetched message waits for a free worker before its
            # progress reports start, so fetch no more than one ahead.
            pull_sub=PullSub(batch_size=1, timeout=2.0),
            ack_policy=AckPolicy.MANUAL,
            config=config,
            decoder=_undecoded,
            inbox_prefix=f"{bus.inbox}.".encode(),
            **kwargs,
        )(_on_message)


async def _undecoded(msg: Any) -> bytes:
    """The handler parses the body itself: the framework's JSON decoding raises on input it
    cannot decode (e.g. 20,000 nesting levels) before any handler runs, and such a message
    would be redelivered until JetStream gives up on it, never dead-lettered."""
    body: bytes = msg.body
    return body


async def _keep_alive(msg: Any, ack_wait: float) -> None:
    """Long work (embedding a big document) must not be redelivered to another worker, while
    the work of a worker that died is redelivered after one (short) ack wait."""
    while True:
        await asyncio.sleep(max(ack_wait / 3, 1.0))
        with contextlib.suppress(Exception):
            await msg.in_progress()


def _validation_reason(err: ValidationError) -> str:
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}" for e in err.errors()]
    return "malformed event: " + "; ".join(parts)


__all__ = [
    "BUS_UNAVAILABLE",
    "CURRENT_PUBLISHER",
    "JSTREAM",
    "Bus",
    "InvalidInput",
    "consume",
    "dead_letter",
    "unavailable",
]
