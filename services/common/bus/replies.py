"""Request/reply on core NATS: the search service's subjects (`search.query`, `search.chunk`,
`search.ask`), asked and answered with nats-py directly, on the bus's one connection.

Everything else goes through FastStream (client.py). Not this: FastStream's request and
queue-group subscriber with tracing cost 1.2 ms more a round trip than these (p50 1.83 vs
0.63 ms; p90 7.0 vs 1.7), 7 % of a 16 ms search, and a reply needs nothing FastStream adds
to consumers (docs/benchmarks.md, "search request/reply on nats-py";
`python -m benchmarks.bus_request_reply`).

A trace still crosses the hop: the requester puts its context in the message headers (W3C
`traceparent`) inside a CLIENT span `<subject> request`, and the responder carries it on in
a SERVER span `<subject> process`, the names FastStream's middleware gives its own spans.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Tracer

log = logging.getLogger("kbmesh.bus")

Handler = Callable[[bytes], Awaitable[bytes]]
DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's default; a reply must fit in one message


class Responder:
    """Answers requests on `subject` as a member of queue group `queue` (replicas share the
    load), at most `concurrency` at once: more wait in the subscription until one ends.

    `handler` turns request bytes into reply bytes and reports failures in its reply: an
    exception escaping it is logged and leaves the requester to its timeout."""

    def __init__(self, subject: str, handler: Handler, *, queue: str, concurrency: int) -> None:
        self.subject = subject
        self.queue = queue
        self._handler = handler
        self._slots = asyncio.Semaphore(max(1, concurrency))
        self._running: set[asyncio.Task[None]] = set()
        self._subscription: Subscription | None = None
        self._tracer: Tracer | None = None

    async def start(self, nc: nats.NATS, tracer: Tracer) -> None:
        self._tracer = tracer
        self._subscription = await nc.subscribe(self.subject, queue=self.queue, cb=self._received)

    async def _received(self, msg: Msg) -> None:
        # nats-py runs a subscription's callbacks one after another: answers run as tasks,
        # and waiting here for a free slot holds the next request back.
        await self._slots.acquire()
        task = asyncio.create_task(self._answer(msg))
        self._running.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._slots.release()

    async def _answer(self, msg: Msg) -> None:
        assert self._tracer is not None
        parent = propagate.extract(msg.headers or {})
        name = f"{self.subject} process"
        with self._tracer.start_as_current_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=_destination(self.subject)
        ):
            try:
                body = await self._handler(msg.data)
            except Exception:
                log.exception("reply_failed subject=%s", self.subject)
                return
        if not msg.reply:
            return  # published, not asked: nobody waits for an answer
        try:
            await msg.respond(body)
        except nats.errors.Error as err:  # the connection went away: the requester times out
            log.warning("reply_not_sent subject=%s error=%r", self.subject, err)

    async def stop(self, grace_seconds: float = 10.0) -> None:
        """No new requests; those already taken get `grace_seconds` to be answered."""
        if self._subscription is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._subscription.unsubscribe()
            self._subscription = None
        running = list(self._running)
        if not running:
            return
        _, late = await asyncio.wait(running, timeout=grace_seconds)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)


async def request(
    nc: nats.NATS, tracer: Tracer, subject: str, data: bytes, timeout: float
) -> bytes:
    """The reply to `data` on `subject`. Raises nats-py's `TimeoutError` (a `TimeoutError`)
    when none comes in time and `NoRespondersError` when nobody listens."""
    headers: dict[str, str] = {}
    with tracer.start_as_current_span(
        f"{subject} request", kind=SpanKind.CLIENT, attributes=_destination(subject)
    ):
        propagate.inject(headers)
        reply = await nc.request(subject, data, timeout=timeout, headers=headers)
    return reply.data


# A reply is `{"result": <JSON>}` or `{"error": <RemoteError>}`, put together from the JSON
# the responder serialised, so that a requester can also take the result's JSON as it is.
_RESULT = b'{"result":'


def envelope(key: str, body: bytes) -> bytes:
    """The reply holding `body` (JSON) as its `key`, "result" or "error"."""
    return b'{"' + key.encode() + b'":' + body + b"}"


def result_json(reply: bytes) -> bytes | None:
    """The result's JSON as the responder serialised it; None for any other reply."""
    if reply.startswith(_RESULT) and reply.endswith(b"}"):
        return reply[len(_RESULT) : -1]
    return None


def _destination(subject: str) -> dict[str, str]:
    return {"messaging.system": "nats", "messaging.destination.name": subject}
