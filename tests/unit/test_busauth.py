"""The bus permission model (services/common/bus/auth.py) read as nats-server reads it: who
may publish and subscribe to what, the key store's single writer, publishers bound to one
org, and the data directory's credential files."""

from __future__ import annotations

import stat

import pytest

from services.common.bus import auth as busauth
from services.common.bus.auth import (
    ACCOUNT,
    ROLES,
    SERVICE_ROLES,
    Credentials,
    Publisher,
    PublisherRecord,
    permissions,
    publisher_of,
    server_accounts,
    upstream_subject,
)
from services.common.domain.errors import InvalidInput
from tests.support.bus import matches


def may_publish(role: str, subject: str) -> bool:
    return any(matches(p, subject) for p in permissions(role).publish)


def may_subscribe(role: str, subject: str) -> bool:
    return any(matches(p, subject) for p in permissions(role).subscribe)


KEY_WRITES = (
    "$KV.keys.0123abcd",
    "$JS.API.STREAM.UPDATE.KV_keys",
    "$JS.API.STREAM.DELETE.KV_keys",
    "$JS.API.STREAM.PURGE.KV_keys",
    "$JS.API.STREAM.MSG.DELETE.KV_keys",
    "$JS.API.STREAM.RESTORE.KV_keys",
)


@pytest.mark.parametrize("role", [r for r in ROLES if r != "operator"] + ["embed+search"])
def test_only_the_operator_writes_the_key_store(role):
    """No service user — nor `kbmesh up`'s combined one — can put, purge or reconfigure the
    API-key bucket; all of them may read it."""
    assert not [s for s in KEY_WRITES if may_publish(role, s)]
    assert all(may_publish("operator", s) for s in KEY_WRITES)
    assert may_publish(role, "$JS.API.DIRECT.GET.KV_keys.$KV.keys.0123abcd")


@pytest.mark.parametrize(
    ("role", "allowed", "refused"),
    [
        (
            "ingest",
            ["kb.index", "kb.remove", "doc.failed", "$KV.documents.o.d", "$O.texts.C.x"],
            ["doc.uploaded", "doc.indexed", "$KV.index.k.d", "$KV.kbs.o.k", "search.query"],
        ),
        (
            "embed",
            ["doc.indexed", "doc.failed", "$KV.index.k.d", "$KV.kbs.o.k"],
            ["kb.index", "doc.uploaded", "$KV.documents.o.d", "$O.texts.C.x", "$KV.prompts.x"],
        ),
        (
            "search",
            [],
            ["doc.uploaded", "kb.index", "$KV.kbs.o.k", "$KV.documents.o.d", "$O.texts.C.x"],
        ),
        (
            "gateway",
            ["doc.uploaded", "kb.changed", "search.query", "$KV.kbs.o.k", "$KV.prompts.o.p"],
            ["$KV.index.k.d", "$JS.API.STREAM.DELETE.KBMESH", "$JS.API.STREAM.PURGE.KBMESH"],
        ),
        (
            "sources",
            [
                "doc.uploaded",
                "doc.deleted",
                "source.run",
                "$KV.sources.o.s.state",
                "$O.texts.C.x",
                "$JS.API.CONSUMER.MSG.NEXT.KBMESH.sources-source-sync",
            ],
            [
                "kb.index",
                "kb.changed",
                "tags.changed",
                "source.sync",
                "$KV.documents.o.d",
                "$KV.source-secrets.o.s",
                "$KV.kbs.o.k",
                "search.query",
                "doc.uploaded.upstream.o.p",
            ],
        ),
    ],
)
def test_each_service_publishes_what_its_work_needs_only(role, allowed, refused):
    assert [s for s in allowed if not may_publish(role, s)] == []
    assert [s for s in refused if may_publish(role, s)] == []


def test_replies_arrive_in_each_users_own_inbox():
    """A user reads replies under `_INBOX.<user>` only: the gateway cannot read the replies
    the operator's CLI gets (key records) nor search's (document text)."""
    for role in SERVICE_ROLES:
        assert may_subscribe(role, f"_INBOX.{role}.abc")
        others = [r for r in ROLES if r != role]
        assert not [r for r in others if may_subscribe(role, f"_INBOX.{r}.abc")]
    assert permissions("search").responses and not permissions("gateway").responses


def test_only_the_operator_may_ask_for_a_kbs_vectors_and_embed_answers():
    """`vectors.export` hands out any KB's chunks and vectors: the operator's backup asks,
    embed answers, and no service user (the gateway, `kbmesh up`'s combined one) can ask."""
    assert may_publish("operator", "vectors.export")
    assert [r for r in ROLES if may_publish(r, "vectors.export")] == ["operator"]
    assert may_subscribe("embed", "vectors.export") and permissions("embed").responses
    assert not [r for r in ("ingest", "search", "gateway") if may_subscribe(r, "vectors.export")]


def test_stack_is_the_union_of_the_four_services():
    stack = permissions("stack")
    for role in SERVICE_ROLES:
        own = permissions(role)
        assert set(own.publish) <= set(stack.publish)
        assert set(own.subscribe) - {f"_INBOX.{role}.>"} <= set(stack.subscribe)
    assert permissions("embed+search").responses


def test_no_service_publishes_an_upstream_identity_but_gateway_replays():
    """Only the operator and the gateway (replaying a dead letter onto its original subject)
    may publish the subjects that carry a publisher's identity."""
    forged = "doc.uploaded.upstream.acme.feeder"
    assert [r for r in ROLES if may_publish(r, forged)] == ["operator", "stack", "gateway"]


def test_a_publisher_is_an_account_that_sees_four_subjects_of_one_org():
    records = [
        PublisherRecord(name="feeder", org_id="acme", password="p1"),
        PublisherRecord(name="other", org_id="beta", password="p2"),
    ]
    users = {role: Credentials(role, "pw") for role in ROLES}
    accounts = server_accounts(users, records)
    assert set(accounts) == {ACCOUNT, "PUB_feeder", "PUB_other"}
    feeder = accounts["PUB_feeder"]
    assert feeder["users"] == [{"user": "feeder", "password": "p1"}]
    assert "jetstream" not in feeder and "permissions" not in feeder["users"][0]
    inside = {i["service"]["subject"]: i["to"] for i in feeder["imports"] if "service" in i}
    assert inside == {
        "doc.uploaded.upstream.acme.feeder": "doc.uploaded",
        "ocr.done.upstream.acme.feeder": "ocr.done",
        "tags.changed.upstream.acme.feeder": "tags.changed",
        "doc.deleted.upstream.acme.feeder": "doc.deleted",
    }
    status = {i["stream"]["subject"]: i["to"] for i in feeder["imports"] if "stream" in i}
    assert status == {
        "upstream.acme.doc.indexed": "doc.indexed",
        "upstream.acme.doc.failed": "doc.failed",
    }
    # Every export names the one account allowed to import it.
    exports = accounts[ACCOUNT]["exports"]
    for export in exports:
        subject = export.get("service") or export.get("stream")
        owner = "PUB_feeder" if ("acme" in subject) else "PUB_other"
        assert export["accounts"] == [owner], export


def test_publisher_of_reads_the_identity_the_server_wrote():
    publisher = Publisher(name="feeder", org_id="acme")
    assert publisher_of(upstream_subject("doc.uploaded", publisher)) == publisher
    assert publisher_of("doc.uploaded") is None
    assert publisher_of("kb.index") is None
    assert publisher_of("tags.changed.upstream.acme") is None


def test_credentials_are_made_once_and_kept_private(tmp_path):
    data = tmp_path / "data"
    first = busauth.local_credentials(data)
    assert set(first) == set(ROLES) and len({c.password for c in first.values()}) == len(ROLES)
    assert busauth.local_credentials(data) == first
    path = data / busauth.CREDENTIALS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert busauth.recorded_credentials(data, "gateway") == first["gateway"]


def test_publishers_are_added_listed_and_revoked(tmp_path):
    record = busauth.add_publisher(tmp_path, "feeder", "acme")
    with pytest.raises(ValueError, match="exists"):
        busauth.add_publisher(tmp_path, "feeder", "beta")
    with pytest.raises(InvalidInput):
        busauth.add_publisher(tmp_path, "bad.name", "acme")
    assert [r.publisher for r in busauth.load_publishers(tmp_path)] == [record.publisher]
    assert stat.S_IMODE((tmp_path / busauth.PUBLISHERS_FILE).stat().st_mode) == 0o600
    assert busauth.revoke_publisher(tmp_path, "feeder")
    assert not busauth.revoke_publisher(tmp_path, "feeder")
    assert busauth.load_publishers(tmp_path) == []


# --- administration is the operator's; each role's work is its own -------------------------

SERVICE_USERS = [r for r in ROLES if r != "operator"] + ["embed+search"]
ADMINISTRATION = (
    "$JS.API.STREAM.CREATE.PLANTED",
    "$JS.API.STREAM.UPDATE.KBMESH_AUDIT",
    "$JS.API.STREAM.DELETE.KBMESH_AUDIT",
    "$JS.API.STREAM.PURGE.KBMESH_AUDIT",
    "$JS.API.STREAM.UPDATE.KBMESH",
    "$JS.API.STREAM.PURGE.KBMESH",
    "$JS.API.STREAM.UPDATE.KV_kbs",
    "$JS.API.STREAM.UPDATE.OBJ_texts",
    "$JS.API.STREAM.RESTORE.KBMESH",
    "$JS.API.CONSUMER.CREATE.KBMESH",
    "$JS.API.CONSUMER.CREATE.KBMESH.ingest-doc-uploaded",
    "$JS.API.CONSUMER.CREATE.KBMESH.ingest-doc-uploaded.doc.uploaded",
    "$JS.API.CONSUMER.DURABLE.CREATE.KBMESH.ingest-doc-uploaded",
    "$JS.API.CONSUMER.DELETE.KBMESH.ingest-doc-uploaded",
    "$JS.API.CONSUMER.PAUSE.KBMESH.ingest-doc-uploaded",
    "$JS.API.CONSUMER.CREATE.KBMESH_AUDIT",
    "$JS.API.CONSUMER.CREATE.KBMESH_DLQ",
)


@pytest.mark.parametrize("role", SERVICE_USERS)
def test_no_service_administers_streams_or_consumers(role):
    """Creating, changing, purging or deleting a stream or a durable consumer is the
    operator's; a service may create only ephemeral readers of the buckets and texts."""
    assert [s for s in ADMINISTRATION if may_publish(role, s)] == []
    assert all(may_publish("operator", s) for s in ADMINISTRATION)
    assert may_publish(role, "$JS.API.CONSUMER.CREATE.KV_kbs")
    assert may_publish(role, "$JS.API.CONSUMER.CREATE.OBJ_texts")


def test_each_durable_consumer_is_pulled_and_acknowledged_by_its_role_only():
    """Every durable consumer of the table has one owner; no other service may pull from it
    or acknowledge its messages (taking, or acking away, another's work)."""
    names = [c.durable for c in busauth.DURABLE_CONSUMERS]
    assert len(names) == len(set(names))
    for role, work in busauth.WORK.items():
        for consumer in work.consumes:
            pull = f"$JS.API.CONSUMER.MSG.NEXT.{consumer.stream}.{consumer.durable}"
            ack = f"$JS.ACK.{consumer.stream}.{consumer.durable}.1.2.3.4.5"
            owners = [r for r in SERVICE_ROLES if may_publish(r, pull) or may_publish(r, ack)]
            assert owners == [role], consumer


@pytest.mark.parametrize(
    ("role", "kinds"),
    [("ingest", {"document"}), ("gateway", {"kb"}), ("embed", set()), ("search", set())],
)
def test_each_service_records_only_its_kind_of_audit_entry(role, kinds):
    allowed = {k for k in ("document", "kb", "key") if may_publish(role, f"audit.acme.{k}")}
    assert allowed == kinds
    assert may_publish("operator", "audit.acme.key")


def test_search_only_answers():
    """The docs' promise: search writes replies only (and reads)."""
    writes = [p for p in permissions("search").publish if not p.startswith("$JS.")]
    assert writes == []
    assert permissions("search").responses


@pytest.mark.parametrize(
    "name", ["operator", "stack", "gateway", "embed-search", "INGEST", "Search"]
)
def test_a_publisher_may_not_take_a_kbmesh_users_name(tmp_path, name):
    """Every kbmesh user name is reserved, in any case: the server would refuse a second
    user of one name, and with it every later change."""
    with pytest.raises(InvalidInput, match="reserved"):
        busauth.add_publisher(tmp_path, name, "acme")
    assert busauth.load_publishers(tmp_path) == []
    users = {role: Credentials(role.replace("+", "-"), "pw") for role in (*ROLES, "embed+search")}
    clash = PublisherRecord(name=name.lower(), org_id="acme", password="p")
    with pytest.raises(ValueError, match="kbmesh NATS user"):
        server_accounts(users, [clash])


def test_a_stored_publisher_with_a_reserved_name_is_left_out(tmp_path):
    """A data directory where an older kbmesh recorded a publisher named `operator` still
    starts: the record is left out of the server's accounts, and revoke removes it."""
    busauth.save_publishers(
        tmp_path,
        [
            PublisherRecord(name="operator", org_id="acme", password="p"),
            PublisherRecord(name="crm", org_id="acme", password="q"),
        ],
    )
    accounts = busauth.local_accounts(tmp_path)
    assert set(accounts) == {ACCOUNT, "PUB_crm"}
    users = [u["user"] for u in accounts[ACCOUNT]["users"]]
    assert users.count("operator") == 1
    assert busauth.revoke_publisher(tmp_path, "operator") is not None


def may_read_secrets(role: str) -> bool:
    """Whether `role` may read a value of the sources' secrets bucket: allowed and not
    denied (nats-server: deny wins)."""
    subject = "$JS.API.DIRECT.GET.KV_source-secrets.$KV.source-secrets.o.s"
    perms = permissions(role)
    allowed = any(matches(p, subject) for p in perms.publish)
    return allowed and not any(matches(d, subject) for d in perms.deny)


def test_only_the_gateway_and_sources_read_sources_secrets():
    """The sources' tokens, keys and webhook secrets: the gateway (which manages them),
    the sources service (which uses them), the processes running either, and the operator;
    no other service, alone or combined."""
    readers = [r for r in (*ROLES, "embed+search", "ingest+gateway") if may_read_secrets(r)]
    assert readers == ["operator", "stack", "gateway", "sources", "ingest+gateway"]
