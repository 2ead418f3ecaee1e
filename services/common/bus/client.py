"""Bus wiring: the broker, streams, KV buckets, publishing with de-duplication, and the
consumer that turns every handler into an at-least-once, dead-lettering one.

Topology (streams, buckets, the object store, the durable consumers of auth.WORK) is set up
apart from its use: `declare_topology` creates or updates it, with the operator's rights
(`Bus.connect(administer=True)`: the CLI, `kbmesh up`'s start, `kbmesh bus setup`); services
only check that it is there (`check_topology`, and their consumers at `start`), since their
NATS users may not change it.

Delivery rules (one place, every service):
- a message that does not parse as its event model, for whatever reason (invalid JSON,
  nesting too deep for any decoder, wrong fields), goes to `dlq.<subject>` at once: the
  decoder hook turns the raw bytes into the event, and any failure there is a refusal;
- an upstream publisher's event for another org than the publisher's is refused the same
  way; while a publisher's event is handled, `CURRENT_PUBLISHER` names it;
- a permanent error (`InvalidInput`) goes to the dead-letter subject at once;
- any other error is retried with backoff (`REDELIVERY_BACKOFF_SECONDS`); after
  `max_deliver` tries it is dead-lettered;
- success acks. The dead letter keeps the original bytes and headers, with the reason in
  `Kbmesh-*` headers, so it can be replayed as is.
- while a handler works it reports progress every third of `ACK_WAIT_SECONDS`, so the ack
  wait can be short: work of a process that died is redelivered within that many seconds.

FastStream carries them: its decoder hook (bytes → event), its ack policy (success acks;
`NackMessage` with the backoff, or `RejectMessage` once dead-lettered) and three
middlewares per subscription, `ProgressReports`, `DeadLetters` and `UpstreamPublishers`;
traces are its `NatsTelemetryMiddleware`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar, cast

import nats
from faststream import AckPolicy, BaseMiddleware, ContextRepo, StreamMessage
from faststream.exceptions import HandlerException, NackMessage, RejectMessage
from faststream.nats import JStream, NatsBroker, NatsRouter, PullSub
from faststream.nats.message import NatsMessage
from faststream.nats.opentelemetry import NatsTelemetryMiddleware
from faststream.nats.security import NatsSecurity, NatsUserPassword
from faststream.types import AsyncFuncAny, BrokerMiddleware
from nats.js import JetStreamContext
from nats.js.api import AckPolicy as JsAckPolicy
from nats.js.api import (
    ConsumerConfig,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import (
    BadRequestError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from opentelemetry.trace import TracerProvider
from pydantic import BaseModel, ValidationError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    stop_before_delay,
    wait_exponential,
    wait_exponential_jitter,
)

from services.common.bus import replies
from services.common.bus.audit import declare_audit_stream
from services.common.bus.auth import (
    CURRENT_PUBLISHER,
    DURABLE_CONSUMERS,
    UPSTREAM_PUBLISH,
    UPSTREAM_STATUS,
    BusNotSetUp,
    Consumer,
    Credentials,
    consumers,
    inbox_prefix,
    publisher_of,
    status_subject,
    upstream_filter,
)
from services.common.bus.deadletters import KBMESH_HEADER, file_letter
from services.common.domain.errors import InvalidInput, KbmeshError, Transient
from services.common.messages.events import EVENT_MODELS, Event
from services.common.messages.names import (
    AUDIT_STREAM,
    DLQ_STREAM,
    KEYS_BUCKET,
    KV_BUCKETS,
    OBJECT_STORE,
    STREAM,
    STREAM_SUBJECTS,
    UPSTREAM_STREAM,
)
from services.common.settings import AuditSettings, BusSettings, NatsAuthSettings

log = logging.getLogger("kbmesh.bus")

T = TypeVar("T")
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
    # A JetStream publish that no stream leader answered (it died, the next is not elected).
    NoStreamResponseError,
)
# How long one step of a start (connecting, declaring the streams, opening the registries,
# starting the consumers) waits for an unavailable bus: far longer than a JetStream leader
# election or a NATS node's restart, so that a start during a failover succeeds. Past it the
# process exits non-zero and its supervisor (compose, Kubernetes) starts it again.
START_DEADLINE_SECONDS = 300.0
# Between tries of a start step: 0.5 s doubling to 5 s, with jitter so that the replicas
# started together do not ask the new leader in step.
START_RETRY_INITIAL_SECONDS = 0.5
START_RETRY_MAX_SECONDS = 5.0
# What a start step that opens streams or buckets also waits for: a stream "not found" while
# it is being created (on a cluster, one created a moment ago may not be found at once from
# every server; a stream that the operator's setup creates may come after the service).
STARTING_STREAMS: tuple[type[Exception], ...] = (NotFoundError,)
# Redelivery delays after the 1st, 2nd, ... failed delivery of a message (the last repeats):
# how long an outage is ridden out before the dead letter is `KBMESH_BUS__MAX_DELIVER`'s.
REDELIVERY_BACKOFF_SECONDS = (0.5, 2.0, 5.0, 15.0)
# A dead worker's unacked message goes to another after this; a working handler reports
# progress every third of it, so long work is never redelivered while it runs.
ACK_WAIT_SECONDS = 10.0


def unavailable(err: BaseException) -> Transient:
    """What a caller is told when NATS (or JetStream's quorum) did not answer in time."""
    return Transient(
        f"the message bus is unavailable ({type(err).__name__}); retry in a few seconds"
    )


# Sends of one event whose acknowledgement could not be read (Bus.publish).
PUBLISH_ATTEMPTS = 3


class BusStartError(RuntimeError):
    """A start that cannot go on: NATS refused this process for good (its credentials or its
    TLS settings), or the bus stayed unavailable for a whole start deadline."""


def start_transient(err: BaseException, waits_for: tuple[type[Exception], ...] = ()) -> bool:
    """What a start waits out: the bus unavailable (a node restarting, no JetStream leader
    while one is elected, no quorum: timeouts, no responders, 503). Anything else ends the
    start at once: JetStream's 4xx and 500 answers are about the request (500 is also what
    three replicas on a single server get), and a bug is a bug. A step may wait for more
    (`waits_for`): e.g. for streams that are being created."""
    return isinstance(err, (*BUS_UNAVAILABLE, *waits_for))


def refused_for_good(err: BaseException) -> bool:
    """What NATS answers to this process's credentials or certificates: the same on every
    try, so retrying only hides it."""
    if isinstance(
        err,
        ssl.SSLCertVerificationError
        | nats.errors.AuthorizationError
        | nats.errors.SecureConnRequiredError
        | nats.errors.SecureConnWantedError,
    ):
        return True
    # The server's words (an "Authentication Timeout", by contrast, is a slow client).
    text = str(err).lower()
    return isinstance(err, nats.errors.Error) and any(
        words in text
        for words in ("authorization violation", "authentication expired", "authentication revoked")
    )


def start_retrying(
    step: str, deadline_seconds: float, waits_for: tuple[type[Exception], ...] = ()
) -> AsyncRetrying:
    """The retry policy of a start step: transient bus errors (`start_transient`) are tried
    again with jittered exponential backoff while the next try would begin within
    `deadline_seconds` of the first; the last error is then raised as it is."""

    def waiting(state: RetryCallState) -> None:
        err = state.outcome.exception() if state.outcome else None
        log.warning(
            "start_waiting step=%s attempt=%d retry_in=%.1f waited=%.1f error=%r",
            step,
            state.attempt_number,
            state.next_action.sleep if state.next_action else 0.0,
            state.seconds_since_start,
            err,
        )

    return AsyncRetrying(
        retry=retry_if_exception(lambda err: start_transient(err, waits_for)),
        wait=wait_exponential_jitter(
            initial=START_RETRY_INITIAL_SECONDS, max=START_RETRY_MAX_SECONDS
        ),
        stop=stop_before_delay(deadline_seconds),
        before_sleep=waiting,
        reraise=True,
    )


UPSTREAM_SUBJECTS = [upstream_filter(s) for s in UPSTREAM_PUBLISH]
# Declared by `declare_topology`; subscribers only reference them.
JSTREAM = JStream(STREAM, subjects=STREAM_SUBJECTS, declare=False)
UPSTREAM_JSTREAM = JStream(UPSTREAM_STREAM, subjects=UPSTREAM_SUBJECTS, declare=False)

# What the streams hold (docs/operations.md, "Limits"). Every stream holding events is capped
# in bytes (`KBMESH_BUS__STREAM_MAX_MB`) and in message size:
# - an event is at most the server's message size less the room a dead letter's headers
#   take, so that whatever fails can be dead-lettered with its reason;
# - each upstream publisher holds at most UPSTREAM_BACKLOG unprocessed events per subject;
#   past it, or once the publishers' stream is full, its publishes are refused (they are
#   removed as ingest processes them, so the refusal lasts as long as the backlog);
# - kbmesh's own events and the dead letters make room by dropping their oldest; dead
#   letters keep at most DEAD_LETTERS_PER_SUBJECT per org and original subject, so one
#   org's (or one publisher's) failures only ever push out its own.
MIB = 1024 * 1024
DEAD_LETTER_HEADROOM = 16 * 1024
UPSTREAM_BACKLOG = 1000
DEAD_LETTERS_PER_SUBJECT = 1000
DEAD_LETTER_DAYS = 30


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
    """One process's link to NATS: FastStream's broker for events, and nats-py for what
    FastStream does not cover (the registries' KV buckets, the `texts` object store, stream
    administration, request/reply) on a connection of its own, opened first by the start's
    connect loop (`_open_connection`), which tells a refusal for good from a passing outage.

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
        start_deadline_seconds: float = START_DEADLINE_SECONDS,
        backoff: Sequence[float] = REDELIVERY_BACKOFF_SECONDS,
        ack_wait: float = ACK_WAIT_SECONDS,
    ) -> None:
        self.start_deadline_seconds = start_deadline_seconds
        # Delivery rules (dead letters, retention), the NATS user and TLS, and the audit
        # stream's retention: the settings groups the bus reads, and no other.
        self.rules = rules or BusSettings()
        self.backoff = tuple(backoff)
        self.ack_wait = ack_wait
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
        # nats-py's connection options (`_open_connection`), and FastStream's the same way.
        self._options: dict[str, Any] = {"inbox_prefix": self.inbox}
        security: NatsSecurity | None = NatsSecurity(ssl_context=tls) if tls else None
        if credentials is not None:
            self._options |= {"user": credentials.user, "password": credentials.password}
            security = NatsUserPassword(credentials.user, credentials.password, ssl_context=tls)
        if tls is not None:
            self._options["tls"] = tls
        self.broker = NatsBroker(
            self.servers,
            name="kbmesh",
            # NATS may be away for any time (restarted, a cluster failing over): never give up.
            max_reconnect_attempts=-1,
            middlewares=[NatsTelemetryMiddleware(tracer_provider=tracer_provider)],
            logger=logging.getLogger("kbmesh.faststream"),
            security=security,
            inbox_prefix=self.inbox,
        )
        # nats-py's connection, for what FastStream does not cover: JetStream's buckets,
        # object store and administration, and request/reply (replies.py).
        self.nc: nats.NATS | None = None
        self._js: JetStreamContext | None = None
        self.consumers: list[Consumer] = []  # the durable consumers this process pulls from
        self.refused: str | None = None  # the last request the server refused this user
        self.responders: list[replies.Responder] = []  # request/reply, started with the rest
        self._tracer = tracer_provider.get_tracer("kbmesh.bus")

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise RuntimeError("bus not connected")
        return self._js

    async def connect(self, *, administer: bool | None = None) -> None:
        """Connect, then with `administer` (a user with the operator's rights) create or
        update the topology (idempotent), else check that it is there. Without `administer`
        given, a connection without credentials (a NATS without users, where any connection
        may) sets it up, and a service's user checks it.

        Like every step of a start (`starting`), it waits out a bus that is unavailable for
        now (a node restarting, a cluster electing its JetStream leader) for up to the start
        deadline, and ends at once when NATS refuses this process for good (credentials,
        TLS); either way with a `BusStartError` that says what happened."""
        self.nc = await self._open_connection()
        js = self._js = self.nc.jetstream()
        nc = self.nc
        if administer is None:
            administer = self.user is None
        if administer:
            await self.starting(
                "streams",
                lambda: declare_topology(
                    js, self.rules, self._audit, max_payload=nc.max_payload, ack_wait=self.ack_wait
                ),
            )
        else:
            await self.starting("streams", lambda: check_topology(js))
        # FastStream's own connection to the same servers, with the same credentials.
        await self.starting(
            "connection",
            lambda: asyncio.wait_for(self.broker.connect(), self.start_deadline_seconds),
        )

    async def _open_connection(self) -> nats.NATS:
        """nats-py tries the servers in turn for as long as it is let (so that the process
        survives any outage once it runs): bounded here by the start deadline, and cut short
        by the first answer that no retry can change."""
        nc = nats.NATS()
        connected = False
        last: list[BaseException] = []

        async def on_error(err: Exception) -> None:
            if "permissions violation" in str(err).lower():
                # nats-py reports a request the server refused here, and the request goes
                # unanswered: remember it, so that the wait for the answer can say why.
                self.refused = str(err)
            if not connected and refused_for_good(err):
                # Raised through nats-py's connect loop, which ends with it.
                raise BusStartError(self._refusal(err)) from err
            last[:] = [err]
            log.warning("nats_connection_error error=%r", err)

        try:
            async with asyncio.timeout(self.start_deadline_seconds):
                await nc.connect(
                    self.servers,
                    name="kbmesh",
                    max_reconnect_attempts=-1,
                    error_cb=on_error,
                    **self._options,
                )
        except BaseException as err:
            # Bounded: closing after a failed TLS handshake waits for a goodbye that never
            # comes.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)
            if isinstance(err, TimeoutError):
                raise BusStartError(self._gave_up("connecting", last[0] if last else err)) from err
            raise
        connected = True
        return nc

    def _refusal(self, err: Exception) -> str:
        where = f"NATS at {self.url}"
        if isinstance(err, ssl.SSLCertVerificationError):
            return (
                f"{where}: the server's certificate is not trusted ({err.verify_message}); set "
                "KBMESH_NATS__TLS_CA_FILE to the CA that signed it"
            )
        if isinstance(err, nats.errors.SecureConnRequiredError | nats.errors.SecureConnWantedError):
            return f"{where}: TLS required by one side only ({err}); check KBMESH_NATS__TLS_*"
        reason = str(err).removeprefix("nats: ").strip("'")
        who = f"user {self.user!r}" if self.user else "a connection without credentials"
        return f"{where} refused {who}: {reason}; check KBMESH_NATS__USER and KBMESH_NATS__PASSWORD"

    def _gave_up(self, step: str, err: BaseException) -> str:
        return (
            f"the message bus at {self.url} was not ready within "
            f"{self.start_deadline_seconds:g} s while starting ({step}); last error: {err!r}"
        )

    async def starting(
        self,
        step: str,
        call: Callable[[], Awaitable[T]],
        *,
        waits_for: tuple[type[Exception], ...] = (),
    ) -> T:
        """`call()`, one idempotent step of this process's start, under `start_retrying`:
        while the bus is unavailable (or `call` raises one of `waits_for`) it is tried
        again, for up to the start deadline; then `BusStartError`. Other errors are raised
        at once."""

        async def attempt() -> T:  # tenacity awaits only what a coroutine function returns
            self.refused = None
            try:
                return await call()
            except BUS_UNAVAILABLE as err:
                if self.refused is not None:
                    # No answer because the server refused to ask: the same on every try.
                    raise PermissionError(
                        f"NATS user {self.user!r} may not do this ({step}): {self.refused}"
                    ) from err
                raise

        try:
            return await start_retrying(step, self.start_deadline_seconds, waits_for)(attempt)
        except Exception as err:
            if start_transient(err, waits_for):
                raise BusStartError(self._gave_up(step, err)) from err
            raise

    async def start(self) -> None:
        """Start consuming and answering (after every router and responder was added),
        waiting out an unavailable bus like `connect`."""
        await self.starting("consumers", self._start_consumers, waits_for=STARTING_STREAMS)

    async def _start_consumers(self) -> None:
        try:
            await self._check_consumers()
            await self.broker.start()
            for responder in self.responders:
                await responder.start(self._connection(), self._tracer)
        except BaseException:
            # Undo what did start, so that the next try starts each subscriber once.
            await self._stop_consumers()
            raise

    async def _stop_consumers(self) -> None:
        for responder in self.responders:
            await responder.stop()
        for subscriber in self.broker.subscribers:
            try:
                await subscriber.stop()
            except Exception as err:  # the bus that failed the start may fail this too
                log.warning("subscriber_not_stopped error=%r", err)

    async def _check_consumers(self) -> None:
        """The durable consumers this process pulls from exist with this process's ack wait
        and delivery limit (its progress reports and dead-lettering count on them): the
        topology step made them so, and a service may not change them."""
        for consumer in self.consumers:
            wanted = consumer_config(consumer, self.rules, self.ack_wait)
            try:
                current = (await self.js.consumer_info(consumer.stream, consumer.durable)).config
            except NotFoundError as err:
                raise BusNotSetUp(f"durable consumer {consumer.durable} does not exist") from err
            if (current.ack_wait, current.max_deliver) != (wanted.ack_wait, wanted.max_deliver):
                raise BusNotSetUp(
                    f"durable consumer {consumer.durable} has ack wait {current.ack_wait}s and "
                    f"delivery limit {current.max_deliver}, this process expects "
                    f"{wanted.ack_wait}s and {wanted.max_deliver} (KBMESH_BUS__MAX_DELIVER)"
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
        headers = {"content-type": "application/json"}
        # An acknowledgement that arrives empty (seen from a clustered JetStream under load)
        # says nothing of whether the stream took the event: send it again, which the
        # stream de-duplicates by `Nats-Msg-Id`.
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(json.JSONDecodeError),
            stop=stop_after_attempt(PUBLISH_ATTEMPTS),
            wait=wait_exponential(multiplier=0.1, max=1.0),
            reraise=True,
        ):
            with attempt:
                await self.broker.publish(
                    body,
                    subject,
                    headers={"Nats-Msg-Id": event.event_id, **headers},
                    stream=STREAM,
                    timeout=10.0,
                )
        if subject in UPSTREAM_STATUS:
            await self.broker.publish(body, status_subject(event.org_id, subject), headers=headers)

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
    js: JetStreamContext,
    bus: BusSettings,
    audit: AuditSettings | None = None,
    *,
    max_payload: int = replies.DEFAULT_MAX_PAYLOAD,
    ack_wait: float = ACK_WAIT_SECONDS,
) -> None:
    """Streams, buckets, the object store and the durable consumers of auth.WORK, with
    today's settings (`max_payload`: the server's message size limit; `ack_wait`: the
    consumers', as `consume` uses it). The operator's work: no service may change these."""
    audit = audit or AuditSettings()
    max_bytes = bus.stream_max_mb * MIB
    max_event = max_payload - DEAD_LETTER_HEADROOM
    stream = StreamConfig(
        name=STREAM,
        subjects=STREAM_SUBJECTS,
        storage=StorageType.FILE,
        max_age=bus.stream_max_age_days * 86400,
        max_bytes=max_bytes,
        max_msg_size=max_event,
        discard=DiscardPolicy.OLD,
        duplicate_window=120.0,
        num_replicas=bus.replicas,
    )
    upstream = StreamConfig(
        name=UPSTREAM_STREAM,
        subjects=UPSTREAM_SUBJECTS,
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=bus.stream_max_age_days * 86400,
        max_bytes=max_bytes,
        max_msg_size=max_event,
        max_msgs_per_subject=UPSTREAM_BACKLOG,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        duplicate_window=120.0,
        num_replicas=bus.replicas,
    )
    dlq = StreamConfig(
        name=DLQ_STREAM,
        subjects=["dlq.>"],
        storage=StorageType.FILE,
        max_age=DEAD_LETTER_DAYS * 86400,
        max_bytes=max_bytes,
        max_msg_size=max_payload,
        max_msgs_per_subject=DEAD_LETTERS_PER_SUBJECT,
        discard=DiscardPolicy.OLD,
        num_replicas=bus.replicas,
    )
    # In this order: kbmesh's own stream gives up the publishers' subjects (it held them
    # before they had a stream of their own) before that stream takes them.
    for config in (stream, upstream, dlq):
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)
    await declare_audit_stream(js, audit, bus.replicas)
    for bucket in KV_BUCKETS:
        if bucket == KEYS_BUCKET:
            with contextlib.suppress(NotFoundError):
                _check_key_bucket((await js.stream_info(f"KV_{bucket}")).config)
        await _set_replicas(js, f"KV_{bucket}", bus.replicas)
        await js.create_key_value(bucket=bucket, history=1, replicas=bus.replicas)
    await _set_replicas(js, f"OBJ_{OBJECT_STORE}", bus.replicas)
    await js.create_object_store(OBJECT_STORE, replicas=bus.replicas)
    for consumer in DURABLE_CONSUMERS:
        await declare_consumer(js, consumer, bus, ack_wait)


def consumer_config(
    consumer: Consumer, bus: BusSettings, ack_wait: float = ACK_WAIT_SECONDS
) -> ConsumerConfig:
    return ConsumerConfig(
        name=consumer.durable,
        durable_name=consumer.durable,
        filter_subject=consumer.subject,
        ack_policy=JsAckPolicy.EXPLICIT,
        ack_wait=ack_wait,
        # JetStream's own limit is a backstop above ours: we dead-letter first.
        max_deliver=bus.max_deliver + 2,
    )


async def declare_consumer(
    js: JetStreamContext, consumer: Consumer, bus: BusSettings, ack_wait: float = ACK_WAIT_SECONDS
) -> None:
    """Create `consumer`, or give an existing one (it outlives processes and versions)
    today's ack wait and delivery limit, keeping the rest of its configuration."""
    wanted = consumer_config(consumer, bus, ack_wait)
    try:
        current = (await js.consumer_info(consumer.stream, consumer.durable)).config
    except NotFoundError:
        await js.add_consumer(consumer.stream, wanted)
        return
    if (current.ack_wait, current.max_deliver) != (wanted.ack_wait, wanted.max_deliver):
        await js.add_consumer(
            consumer.stream,
            current.evolve(ack_wait=wanted.ack_wait, max_deliver=wanted.max_deliver),
        )


async def check_topology(js: JetStreamContext) -> None:
    """Every stream, bucket and the object store exists (a service may not create them), and
    the API-key bucket is a plain one."""
    streams = (
        STREAM,
        UPSTREAM_STREAM,
        DLQ_STREAM,
        AUDIT_STREAM,
        *(f"KV_{b}" for b in KV_BUCKETS),
        f"OBJ_{OBJECT_STORE}",
    )
    with contextlib.suppress(NotFoundError):  # first: it is a trust check, not a set-up one
        _check_key_bucket((await js.stream_info(f"KV_{KEYS_BUCKET}")).config)
    for name in streams:
        try:
            await js.stream_info(name)
        except NotFoundError as err:
            raise BusNotSetUp(f"stream {name} does not exist") from err


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


async def dead_letter(
    bus: Bus, msg: Any, reason: str, error_type: str, event: Event | None = None
) -> None:
    """Publish the original message to its org's dead letters (deadletters.py says which org
    and how) with the reason in headers; `event` is the message parsed, when it parsed."""
    meta = msg.metadata
    subject, letter = file_letter(
        msg.subject, msg.data, event, reason, error_type, meta.num_delivered
    )
    # The message's own headers travel with it, but none that could pass for kbmesh's.
    headers = {
        k: v
        for k, v in (msg.headers or {}).items()
        if k != "Nats-Msg-Id" and not k.startswith(KBMESH_HEADER)
    }
    headers.update(letter)
    headers["Nats-Msg-Id"] = f"dlq-{meta.stream}-{meta.sequence.stream}"
    await bus.broker.publish(msg.data, subject, headers=headers, stream=DLQ_STREAM, timeout=10.0)
    log.warning("dead_letter subject=%s error_type=%s reason=%s", subject, error_type, reason[:300])


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
    kwargs: dict[str, Any] = {}
    if max_workers > 1:
        kwargs["max_workers"] = max_workers
    # Outermost first: progress reports cover the whole delivery, dead-lettering included.
    middlewares: list[BrokerMiddleware[Any]] = [
        partial(ProgressReports, ack_wait=bus.ack_wait),
        partial(DeadLetters, bus=bus, on_failure=on_failure),
    ]
    # The topology step creates these durable consumers (auth.WORK), and `start` stops a
    # process whose consumer it did not create, or created with other settings.
    for consumer in consumers(subject, durable, upstream=upstream):
        bus.consumers.append(consumer)
        own_stream, chain = JSTREAM, middlewares
        if consumer.stream == UPSTREAM_STREAM:
            own_stream, chain = UPSTREAM_JSTREAM, [*middlewares, UpstreamPublishers]
        # A router of its own per subscription: FastStream binds middlewares to routers.
        own = NatsRouter(middlewares=chain)
        own.subscriber(
            consumer.subject,
            stream=own_stream,
            durable=consumer.durable,
            # One message per pull: a fetched message waits for a free worker before its
            # progress reports start, so fetch no more than one ahead.
            pull_sub=PullSub(batch_size=1, timeout=2.0),
            # Success acks; `DeadLetters` answers every failure with `NackMessage` or
            # `RejectMessage`. What escapes it (the dead letter could not be published) is
            # nacked: the message stays, to be delivered again.
            ack_policy=AckPolicy.NACK_ON_ERROR,
            decoder=_decoder(EVENT_MODELS[subject]),
            inbox_prefix=f"{bus.inbox}.".encode(),
            **kwargs,
        )(handler)
        router.include_router(own)


class Refused(Exception):
    """A message its consumer will not take: not its event, or an upstream publisher's event
    for another org. Dead-lettered at once, and the owner's failure hook does not run: no
    event of the owner's was accepted (a hook acting on a foreign org's event would act for
    that org)."""

    def __init__(self, reason: str, error_type: str) -> None:
        super().__init__(reason)
        self.error_type = error_type


def _decoder(model: type[Event]) -> Callable[[NatsMessage], Awaitable[Event]]:
    """FastStream's decoder hook: the raw body to the subject's event. FastStream's own JSON
    decoding would raise on input it cannot decode (e.g. 20,000 nesting levels) as an error
    like any other, redelivered until JetStream gives up on it; here any failure is a
    refusal, dead-lettered at once."""

    async def decode(msg: NatsMessage) -> Event:
        try:
            return model.model_validate_json(msg.body)
        except ValidationError as err:
            raise Refused(_validation_reason(err), "ValidationError") from err
        except (RecursionError, ValueError, MemoryError) as err:
            # Whatever the body is, it will not parse next time either.
            raise Refused(f"malformed event: {err!r}"[:500], "ValidationError") from err

    return decode


class DeadLetters(BaseMiddleware[Any, Any]):
    """The outcome of a delivery that failed, given to FastStream's ack policy as
    `RejectMessage` (dead-lettered: refused, a permanent error, or the last delivery) or
    `NackMessage` with the backoff of this delivery (JetStream delivers it again)."""

    def __init__(
        self,
        msg: Any,
        /,
        *,
        context: ContextRepo,
        bus: Bus,
        on_failure: FailureHook | None,
    ) -> None:
        super().__init__(msg, context=context)
        self.bus = bus
        self.on_failure = on_failure

    async def consume_scope(self, call_next: AsyncFuncAny, msg: StreamMessage[Any]) -> Any:
        raw = msg.raw_message
        try:
            return await call_next(msg)
        except HandlerException:
            raise
        except Refused as err:
            await dead_letter(self.bus, raw, str(err), err.error_type)
            raise RejectMessage from err
        except Exception as err:
            rules = self.bus.rules
            delivered = raw.metadata.num_delivered
            permanent = isinstance(err, KbmeshError) and not err.retryable
            if not permanent and delivered < rules.max_deliver:
                backoff = self.bus.backoff
                delay = backoff[min(delivered, len(backoff)) - 1]
                log.warning(
                    "retry subject=%s delivered=%d delay=%.1f error=%r",
                    raw.subject,
                    delivered,
                    delay,
                    err,
                )
                raise NackMessage(delay=delay) from err
            event = cast(Event, await msg.decode())
            if self.on_failure is not None:
                try:
                    await self.on_failure(event, err)
                except Exception:
                    # The dead letter still goes out; why the owner's record of the failure
                    # (document status, audit entry) is missing goes to the log.
                    log.exception("failure hook raised subject=%s", raw.subject)
            error_type = err.error_type if isinstance(err, KbmeshError) else type(err).__name__
            await dead_letter(self.bus, raw, str(err) or repr(err), error_type, event)
            raise RejectMessage from err


class UpstreamPublishers(BaseMiddleware[Any, Any]):
    """An upstream publisher speaks for its own org only (the subject names it: see auth.py);
    while its event is handled, `CURRENT_PUBLISHER` names it."""

    async def consume_scope(self, call_next: AsyncFuncAny, msg: StreamMessage[Any]) -> Any:
        publisher = publisher_of(msg.raw_message.subject)
        if publisher is None:
            return await call_next(msg)
        # Decoded once: the handler is given this same event.
        event = cast(Event, await msg.decode())
        if event.org_id != publisher.org_id:
            raise Refused(
                f"publisher {publisher.name!r} may publish for org {publisher.org_id!r} only, "
                f"not {event.org_id!r}",
                "Forbidden",
            )
        token = CURRENT_PUBLISHER.set(publisher)
        try:
            return await call_next(msg)
        finally:
            CURRENT_PUBLISHER.reset(token)


class ProgressReports(BaseMiddleware[Any, Any]):
    """Long work (embedding a big document) must not be redelivered to another worker, while
    the work of a worker that died is redelivered after one (short) ack wait: while a
    delivery is handled, it reports progress every third of the ack wait. (FastStream
    reports none by itself.)"""

    def __init__(self, msg: Any, /, *, context: ContextRepo, ack_wait: float) -> None:
        super().__init__(msg, context=context)
        self.every = max(ack_wait / 3, 1.0)

    async def consume_scope(self, call_next: AsyncFuncAny, msg: StreamMessage[Any]) -> Any:
        reports = asyncio.create_task(self._report(cast(NatsMessage, msg)))
        try:
            return await call_next(msg)
        finally:
            reports.cancel()

    async def _report(self, msg: NatsMessage) -> None:
        while True:
            await asyncio.sleep(self.every)
            with contextlib.suppress(Exception):
                await msg.in_progress()


def _validation_reason(err: ValidationError) -> str:
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}" for e in err.errors()]
    return "malformed event: " + "; ".join(parts)


__all__ = [
    "BUS_UNAVAILABLE",
    "CURRENT_PUBLISHER",
    "JSTREAM",
    "STARTING_STREAMS",
    "START_DEADLINE_SECONDS",
    "UPSTREAM_JSTREAM",
    "Bus",
    "BusNotSetUp",
    "BusStartError",
    "InvalidInput",
    "check_topology",
    "consume",
    "consumer_config",
    "dead_letter",
    "declare_consumer",
    "declare_topology",
    "refused_for_good",
    "start_retrying",
    "start_transient",
    "unavailable",
]
