"""What kbmesh's core-NATS traffic costs on each bus library, nats-py and FastStream, both with
the process's tracing on, against one private nats-server, in one process as `kbmesh up`
runs them:

- a search's hop: one request and its reply (`services/common/bus/replies.py` against a
  queue-group FastStream subscriber that returns its reply, asked with `broker.request`);
- a notification the gateway follows (`doc.indexed`: read-your-writes and the progress
  feed), from its publish until a subscriber holds the decoded event.

    .venv/bin/python -m benchmarks.bus_request_reply [--rounds 3000] [--payload 2048]

The handlers do no work (a search reply of `--payload` bytes: a search's JSON is a few kB),
so the figures are the libraries' own. The two libraries alternate message by message, each
after the other's, and the medians are reported with p90.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
from faststream.nats import NatsBroker
from faststream.nats.annotations import NatsMessage
from faststream.nats.opentelemetry import NatsTelemetryMiddleware
from nats.aio.msg import Msg

from benchmarks.common import pct
from services.common.bus.nats_server import NatsServer
from services.common.bus.replies import Responder, envelope, request
from services.common.messages.events import DocIndexed
from services.common.ops.telemetry import configure_telemetry

QUEUE = "search"
Timings = dict[str, list[float]]


async def alternate(paths: dict[str, Callable[[], Awaitable[None]]], rounds: int) -> Timings:
    """Each path once per round, the order swapped every round, after a warm-up."""
    for _ in range(200):  # imports, caches, the server's interest graph
        for call in paths.values():
            await call()
    times: Timings = {name: [] for name in paths}
    for i in range(rounds):
        order = list(paths.items()) if i % 2 == 0 else list(paths.items())[::-1]
        for name, call in order:
            start = time.perf_counter()
            await call()
            times[name].append(time.perf_counter() - start)
    return times


async def run(rounds: int, payload: int) -> dict[str, Timings]:
    provider = configure_telemetry("bench-bus")
    # As the services run it: FastStream's per-message log lines are off (services/cli).
    logger = logging.getLogger("kbmesh.faststream")
    logger.setLevel(logging.WARNING)
    tracer = provider.get_tracer("kbmesh.bus")
    reply = envelope("result", b'"' + b"x" * payload + b'"')
    question = b'{"query":"how do I rotate the logs","top_k":10,"org_id":"org"}'
    note = DocIndexed(org_id="org", kb_id="kb", document_id="doc", revision=3, chunk_count=12)
    note_body = note.model_dump_json().encode()

    async def answer(body: bytes) -> bytes:
        return reply

    with tempfile.TemporaryDirectory() as data:
        server = NatsServer(Path(data)).start()
        try:
            nc = await nats.connect(server.url)
            publisher = await nats.connect(server.url)
            responder = Responder("bench.natspy", answer, queue=QUEUE, concurrency=4)
            await responder.start(nc, tracer)
            heard: asyncio.Queue[DocIndexed] = asyncio.Queue()

            async def on_note(msg: Msg) -> None:
                heard.put_nowait(DocIndexed.model_validate_json(msg.data))

            await nc.subscribe("note.natspy", cb=on_note)

            broker = NatsBroker(
                server.url,
                middlewares=[NatsTelemetryMiddleware(tracer_provider=provider)],
                logger=logger,
            )

            @broker.subscriber("bench.faststream", queue=QUEUE, max_workers=4)
            async def on_request(msg: NatsMessage) -> bytes:
                return await answer(msg.body)

            @broker.subscriber("note.faststream")
            async def on_note_faststream(event: DocIndexed) -> None:
                heard.put_nowait(event)

            await broker.start()

            async def ask_natspy() -> None:
                if await request(nc, tracer, "bench.natspy", question, 5.0) != reply:
                    raise RuntimeError("nats-py answered something else")

            async def ask_faststream() -> None:
                answered = await broker.request(question, "bench.faststream", timeout=5.0)
                if answered.body != reply:
                    raise RuntimeError("FastStream answered something else")

            def notify(subject: str) -> Callable[[], Awaitable[None]]:
                async def send() -> None:
                    await publisher.publish(subject, note_body)
                    if await heard.get() != note:
                        raise RuntimeError(f"{subject} heard something else")

                return send

            results = {
                "request/reply": await alternate(
                    {"nats-py": ask_natspy, "faststream": ask_faststream}, rounds
                ),
                "notification": await alternate(
                    {"nats-py": notify("note.natspy"), "faststream": notify("note.faststream")},
                    rounds,
                ),
            }
            await broker.stop()
            await responder.stop()
            await publisher.close()
            await nc.close()
        finally:
            server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--payload", type=int, default=2048)
    args = parser.parse_args()
    for kind, times in asyncio.run(run(args.rounds, args.payload)).items():
        for name, values in times.items():
            print(
                f"{kind:14s} {name:11s} p50 {statistics.median(values) * 1000:.3f} ms  "
                f"p90 {pct(values, 0.9):.3f} ms  ({len(values)} messages)"
            )
        extra = statistics.median(times["faststream"]) - statistics.median(times["nats-py"])
        ratio = statistics.median(times["faststream"]) / statistics.median(times["nats-py"])
        print(f"{kind:14s} faststream / nats-py: {ratio:.2f}x, +{extra * 1000:.3f} ms a message")


if __name__ == "__main__":
    main()
