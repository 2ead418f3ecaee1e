"""The gateway's bus subscribers: the status notifications and KB record changes that
read-your-writes waits (service/waiting.py) and progress streams (progress.py) follow.

Core NATS subscriptions, not durable consumers: a gateway hears what happens while it
runs, at most once; a wait that hears nothing reads the registries instead, and a stream
starts from a snapshot."""

from __future__ import annotations

from faststream.nats import NatsMessage, NatsRouter

from services.common.messages.events import DocFailed, DocIndexed, KbChanged
from services.common.messages.names import Subject
from services.gateway.service import GatewayService

# The KV bucket of KB records: every write is a message on `$KV.kbs.<org>.<kb>`.
KB_RECORDS = "$KV.kbs.>"


def create_router(service: GatewayService) -> NatsRouter:
    router = NatsRouter()
    waiter, feed = service.waiting.events, service.progress

    @router.subscriber(Subject.DOC_INDEXED)
    async def on_indexed(event: DocIndexed) -> None:
        waiter.dispatch(event)
        feed.event(event)

    @router.subscriber(Subject.DOC_FAILED)
    async def on_failed(event: DocFailed) -> None:
        waiter.dispatch(event)
        feed.event(event)

    @router.subscriber(Subject.KB_CHANGED)
    async def on_kb_changed(event: KbChanged) -> None:
        feed.event(event)

    # The record itself is not read: a stream reads a fresh snapshot.
    @router.subscriber(KB_RECORDS, decoder=_subject_only)
    async def on_kb_record(msg: NatsMessage) -> None:
        feed.kb_record_changed(msg.raw_message.subject.rsplit(".", 1)[-1])

    return router


async def _subject_only(msg: NatsMessage) -> None:
    return None
