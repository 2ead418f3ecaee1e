"""The generated bus roles (services/common/bus/auth.py) on a real nats-server: no
service's user can change what the operator set up — stream, bucket, object store and
consumer configurations — nor pull or acknowledge another role's work, and each role
records only its own kind of audit entry.

A refused publish is never answered: the server tells the client of the violation, and
`Probe` waits for exactly that notice (or for an answer, which means it was allowed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from services.common.bus.audit import AUDIT_STREAM, AuditEntry, audit_subject
from services.common.bus.auth import (
    SERVICE_ROLES,
    Credentials,
    new_password,
    server_accounts,
)
from services.common.bus.client import KV_BUCKETS, OBJECT_STORE, declare_topology
from services.common.bus.nats_server import NatsServer
from services.common.messages.names import (
    DLQ_STREAM,
    SOURCE_SECRETS_BUCKET,
    STREAM,
    Subject,
)
from services.common.settings import BusSettings

# Every user a deployment or `kbmesh up` runs a service as.
SERVICE_USERS = (*SERVICE_ROLES, "stack", "embed+search")
MANAGED_STREAMS = (
    STREAM,
    DLQ_STREAM,
    AUDIT_STREAM,
    *(f"KV_{b}" for b in KV_BUCKETS),
    f"OBJ_{OBJECT_STORE}",
)
# A durable consumer of another role (ingest's), and one of embed's.
INGEST_DURABLE = ("ingest-doc-uploaded", Subject.DOC_UPLOADED)
EMBED_DURABLE = ("embed-kb-index", Subject.KB_INDEX)
AUDIT_ENTRIES = 5


@pytest.fixture(scope="module")
def bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    users = {
        role: Credentials(role.replace("+", "-"), new_password())
        for role in ("operator", *SERVICE_USERS)
    }
    server = NatsServer(
        tmp_path_factory.mktemp("bus-permissions") / "nats",
        accounts=lambda: server_accounts(users),
    ).start()
    try:
        asyncio.run(_set_up(server.url, users["operator"]))
        yield {"url": server.url, "users": users}
    finally:
        server.stop()


async def _set_up(url: str, operator: Credentials) -> None:
    """What the operator's setup leaves behind: the topology, the durable consumers, and an
    audit trail worth protecting."""
    nc = await nats.connect(url, user=operator.user, password=operator.password)
    try:
        js = nc.jetstream()
        await declare_topology(js, BusSettings())
        for durable, subject in (INGEST_DURABLE, EMBED_DURABLE):
            try:
                await js.consumer_info(STREAM, durable)
            except nats.js.errors.NotFoundError:
                await js.add_consumer(
                    STREAM,
                    ConsumerConfig(
                        durable_name=durable,
                        filter_subject=subject,
                        ack_policy=AckPolicy.EXPLICIT,
                        ack_wait=10,
                    ),
                )
        for i in range(AUDIT_ENTRIES):
            entry = AuditEntry(
                org_id="acme",
                kind="kb",
                action="created",
                writer={"kind": "operator"},
                kb_id=f"kb-{i}",
            )
            await js.publish(
                audit_subject("acme", "kb"), entry.model_dump_json().encode(), stream=AUDIT_STREAM
            )
    finally:
        await nc.close()


class Probe:
    """A connection as one user that tells a refused publish from an allowed one."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self._seen = asyncio.Event()
        self.nc: nats.NATS | None = None

    async def _on_error(self, err: Exception) -> None:
        self.violations.append(str(err))
        self._seen.set()

    async def connect(self, url: str, creds: Credentials) -> Probe:
        self.nc = await nats.connect(
            url,
            user=creds.user,
            password=creds.password,
            inbox_prefix=f"_INBOX.{creds.user}",
            error_cb=self._on_error,
            allow_reconnect=False,
        )
        return self

    async def attempt(self, subject: str, body: dict[str, Any] | bytes = b"") -> dict[str, Any]:
        """Send `body` to `subject` as a request: {"refused": True} when the server refused
        the publish, else the answer (a JetStream API answer, or a stream's ack)."""
        assert self.nc is not None
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, max_msgs=1)
        before = len(self.violations)
        await self.nc.publish(subject, data, reply=inbox)
        answer = asyncio.ensure_future(sub.next_msg(timeout=10))
        while not answer.done():
            # nats-py reports the server's notice lower-cased.
            if any(subject.lower() in v.lower() for v in self.violations[before:]):
                answer.cancel()
                await asyncio.gather(answer, return_exceptions=True)
                await sub.unsubscribe()
                return {"refused": True}
            self._seen.clear()
            seen = asyncio.ensure_future(self._seen.wait())
            await asyncio.wait([answer, seen], timeout=10, return_when=asyncio.FIRST_COMPLETED)
            seen.cancel()
        if answer.exception() is not None:
            return {"unanswered": True}  # allowed, and nothing answers it (an ack)
        reply: dict[str, Any] = json.loads(answer.result().data or b"{}")
        return reply

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()


@pytest.fixture
async def operator(bus: dict[str, Any]) -> AsyncIterator[Any]:
    nc = await nats.connect(
        bus["url"], user=bus["users"]["operator"].user, password=bus["users"]["operator"].password
    )
    yield nc.jetstream()
    await nc.close()


async def probe(bus: dict[str, Any], role: str) -> Probe:
    return await Probe().connect(bus["url"], bus["users"][role])


def stream_update(config: StreamConfig, **changes: Any) -> dict[str, Any]:
    return {**config.as_dict(), **changes}


@pytest.mark.parametrize("role", SERVICE_USERS)
async def test_no_service_user_changes_a_stream_configuration(bus, operator, role):
    """As any service's user, an update of every managed stream (the audit trail cut to one
    entry, the work stream's retention, the buckets and the object store), a delete, a purge
    of the audit trail and the creation of a new stream are all refused; the operator finds
    the audit trail whole and every configuration as it set it."""
    before = {name: (await operator.stream_info(name)).config for name in MANAGED_STREAMS}
    client = await probe(bus, role)
    try:
        allowed = []
        for name, config in before.items():
            for subject, body in (
                (f"$JS.API.STREAM.UPDATE.{name}", stream_update(config, max_msgs=1)),
                (f"$JS.API.STREAM.DELETE.{name}", b""),
            ):
                if not (await client.attempt(subject, body)).get("refused"):
                    allowed.append(subject)
        for subject, body in (
            (f"$JS.API.STREAM.PURGE.{AUDIT_STREAM}", b""),
            (f"$JS.API.STREAM.PURGE.{STREAM}", b""),
            ("$JS.API.STREAM.CREATE.PLANTED", {"name": "PLANTED", "subjects": ["audit.>"]}),
        ):
            if not (await client.attempt(subject, body)).get("refused"):
                allowed.append(subject)
        assert allowed == [], f"{role} may {allowed}"
    finally:
        await client.close()
    for name, config in before.items():
        assert (await operator.stream_info(name)).config == config, name
    assert (await operator.stream_info(AUDIT_STREAM)).state.messages >= AUDIT_ENTRIES


@pytest.mark.parametrize("role", SERVICE_USERS)
async def test_no_service_user_changes_a_durable_consumer(bus, operator, role):
    """Not even ingest may change, pause or delete ingest's durable consumer: through the
    named create subject, the filtered one, the legacy ephemeral one with the consumer's
    name, the legacy durable one, or the delete subject. Its ack wait stays the operator's."""
    durable, subject = INGEST_DURABLE
    wanted = (await operator.consumer_info(STREAM, durable)).config
    changed = wanted.evolve(ack_wait=1, max_deliver=1).as_dict()
    client = await probe(bus, role)
    try:
        attempts = [
            (
                f"$JS.API.CONSUMER.CREATE.{STREAM}.{durable}",
                {"stream_name": STREAM, "config": changed},
            ),
            (
                f"$JS.API.CONSUMER.CREATE.{STREAM}.{durable}.{subject}",
                {"stream_name": STREAM, "config": changed},
            ),
            (
                f"$JS.API.CONSUMER.CREATE.{STREAM}",
                {"stream_name": STREAM, "config": {**changed, "durable_name": None}},
            ),
            (
                f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.{durable}",
                {"stream_name": STREAM, "config": changed},
            ),
            (f"$JS.API.CONSUMER.PAUSE.{STREAM}.{durable}", {"pause_until": "2100-01-01T00:00:00Z"}),
            (f"$JS.API.CONSUMER.DELETE.{STREAM}.{durable}", b""),
            (
                f"$JS.API.CONSUMER.CREATE.{AUDIT_STREAM}",
                {"stream_name": AUDIT_STREAM, "config": {}},
            ),
        ]
        allowed = [s for s, body in attempts if not (await client.attempt(s, body)).get("refused")]
        assert allowed == [], f"{role} may {allowed}"
    finally:
        await client.close()
    info = await operator.consumer_info(STREAM, durable)
    assert (info.config.ack_wait, info.config.max_deliver) == (wanted.ack_wait, wanted.max_deliver)
    assert not getattr(info, "paused", False)


@pytest.mark.parametrize("role", [r for r in SERVICE_USERS if r not in ("ingest", "stack")])
async def test_a_role_cannot_pull_or_acknowledge_another_roles_work(bus, role):
    """Only ingest's users pull from ingest's durable consumer: another service's user
    could otherwise take (and acknowledge away) documents ingest never saw."""
    durable, _ = INGEST_DURABLE
    client = await probe(bus, role)
    try:
        pull = await client.attempt(
            f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{durable}", {"batch": 1, "no_wait": True}
        )
        ack = await client.attempt(f"$JS.ACK.{STREAM}.{durable}.1.1.1.0.0", b"+ACK")
        assert pull.get("refused") and ack.get("refused"), (pull, ack)
    finally:
        await client.close()


async def test_ingest_pulls_from_its_own_durable_consumer(bus):
    """The other side of the rule above: ingest's user may ask its consumer for work."""
    durable, _ = INGEST_DURABLE
    client = await probe(bus, "ingest")
    try:
        answer = await client.attempt(
            f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{durable}", {"batch": 1, "no_wait": True}
        )
        assert not answer.get("refused"), answer
    finally:
        await client.close()


# The kinds of audit entry each service records; it may record no other.
AUDIT_KINDS: dict[str, set[str]] = {
    "ingest": {"document"},
    "gateway": {"kb", "source"},
    "embed": set(),
    "search": set(),
    "sources": set(),
}


@pytest.mark.parametrize("role", SERVICE_ROLES)
async def test_each_service_records_only_its_own_kind_of_audit_entry(bus, operator, role):
    """Ingest records document entries, the gateway KB and source entries, the operator key
    entries; embed and search none. No service can store another's kind, directly or by
    changing the audit stream (a subject transform that renames its own entries)."""
    kinds = AUDIT_KINDS[role]
    own = min(kinds) if kinds else None
    client = await probe(bus, role)
    try:
        stored: dict[str, bool] = {}
        for kind in ("document", "kb", "key", "source"):
            answer = await client.attempt(audit_subject("beta", kind), b'{"forged": true}')
            stored[kind] = answer.get("stream") == AUDIT_STREAM
        assert {k for k, ok in stored.items() if ok} == kinds, stored
        config = (await operator.stream_info(AUDIT_STREAM)).config
        rename = {"src": f"audit.*.{own or 'document'}", "dest": "audit.{{wildcard(1)}}.key"}
        renamed = stream_update(config, subject_transform=rename)
        await client.attempt(f"$JS.API.STREAM.UPDATE.{AUDIT_STREAM}", renamed)
        await client.attempt(audit_subject("beta", own or "document"), b'{"forged": true}')
    finally:
        await client.close()
    with pytest.raises(nats.js.errors.NotFoundError):
        await operator.get_last_msg(AUDIT_STREAM, audit_subject("beta", "key"))


SECRET_KEY = "acme.src1"
# The users that may read sources' secrets: the gateway manages them, the sources service
# uses them; `kbmesh up`'s single user runs both.
SECRET_READERS = ("gateway", "sources", "stack")


async def _plant_secret(operator: Any) -> None:
    kv = await operator.key_value(SOURCE_SECRETS_BUCKET)
    await kv.put(SECRET_KEY, b'{"token": "ghp_planted", "webhook_secret": "w"}')


@pytest.mark.parametrize("role", SERVICE_USERS)
async def test_only_gateway_and_sources_read_a_sources_secrets(bus, operator, role):
    """A source's git token is read by the gateway and the sources service only: for every
    other service's user each way to the value — a direct get by key, a direct get by
    sequence, the stream's message get, a watch (an ephemeral consumer) — is refused, while
    the other buckets stay readable to all."""
    await _plant_secret(operator)
    stream = f"KV_{SOURCE_SECRETS_BUCKET}"
    key_subject = f"$KV.{SOURCE_SECRETS_BUCKET}.{SECRET_KEY}"
    client = await probe(bus, role)
    try:
        reads = {
            "direct by key": await client.attempt(f"$JS.API.DIRECT.GET.{stream}.{key_subject}"),
            "direct by sequence": await client.attempt(f"$JS.API.DIRECT.GET.{stream}", {"seq": 1}),
            "message get": await client.attempt(
                f"$JS.API.STREAM.MSG.GET.{stream}", {"last_by_subj": key_subject}
            ),
            "watch": await client.attempt(
                f"$JS.API.CONSUMER.CREATE.{stream}",
                {
                    "stream_name": stream,
                    "config": {"deliver_policy": "last_per_subject", "ack_policy": "none"},
                },
            ),
        }
        others = await client.attempt("$JS.API.DIRECT.GET.KV_kbs", {"seq": 1})
    finally:
        await client.close()
    refused = {what for what, answer in reads.items() if answer.get("refused")}
    if role in SECRET_READERS:
        assert refused == set(), reads
    else:
        assert refused == set(reads), reads
    assert not others.get("refused")
