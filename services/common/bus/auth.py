"""Who may do what on the bus: one NATS user per kbmesh role, each with the least permissions
its work needs, and upstream publishers bound to one org each.

The model is data: `WORK`, one table of what each service does (the durable consumers it
pulls from, the subjects it publishes and follows, the buckets it writes, the kind of audit
entry it records). `permissions(role)` is derived from it, and so are the durable consumers
the topology step creates (services/common/bus/client.py). `server_accounts()` renders the
permissions into nats-server configuration: `kbmesh up` writes it for its private server, and
`deploy/` ships the same rendering with passwords taken from the environment (`kbmesh bus
config`).

- All of kbmesh lives in one NATS account, `KBMESH`, with JetStream. Roles: `operator` (the
  CLI and the topology step: API keys, dead letters, streams, buckets, durable consumers,
  backups; everything in the account, and the only user that may ask embed for a KB's
  vectors, `vectors.export`), `ingest`, `embed`, `search`, `gateway`, `sources`, and
  `stack`, the five services together as `kbmesh up` runs them in one process. No service
  may create, change, purge or delete a stream, bucket, object store or durable consumer;
  only `operator` may write the API-key bucket (`keys`); the others read it.
- Buckets are readable by every service, except the private ones (`PRIVATE_BUCKETS`: the
  sources' git tokens, keys and webhook secrets), which only the roles that name them in
  `Work.reads` or `Work.writes` (and the operator) may read: for the others every way to a
  value — a direct get, a stream message get, a watch — is denied by name.
- Each upstream publisher has an account of its own holding one user. It sees four
  subjects, `doc.uploaded`, `ocr.done`, `tags.changed`, `doc.deleted`, imported from
  `KBMESH` where they arrive as `<subject>.upstream.<org>.<publisher>`: the server writes
  the publisher's name and org into the subject, so no publisher can claim another. Ingest
  refuses (dead-letters) an event whose `org_id` is not the org of its subject. Its status
  notifications, `doc.indexed` and `doc.failed`, come from `upstream.<org>.<subject>`: its
  own org's only. A publisher may not take the name of a kbmesh user (`RESERVED_NAMES`).
- Data directory files holding secrets are written 0600 (`files.write_private`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import operator
import os
import re
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import nats.errors

from services.common.bus.audit import AuditKind, audit_subject
from services.common.domain.errors import InvalidInput
from services.common.domain.ids import check_id
from services.common.messages.names import (
    DLQ_STREAM,
    KV_BUCKETS,
    OBJECT_STORE,
    SOURCE_SECRETS_BUCKET,
    SOURCES_BUCKET,
    STREAM,
    UPSTREAM_STREAM,
    Subject,
)
from services.common.ops.files import write_private

log = logging.getLogger("kbmesh.busauth")

ACCOUNT = "KBMESH"
PUBLISHER_ACCOUNT_PREFIX = "PUB_"
SERVICE_ROLES = ("ingest", "embed", "search", "gateway", "sources")
ROLES = ("operator", "stack", *SERVICE_ROLES)
CREDENTIALS_FILE = "nats-credentials.json"
PUBLISHERS_FILE = "nats-publishers.json"

# The processes `deploy/` runs, by role → NATS user (`serve embed search` shares one).
DEPLOY_USERS = {
    "operator": "operator",
    "ingest": "ingest",
    "embed": "embed",
    "search": "search",
    "gateway": "gateway",
    "sources": "sources",
    "embed+search": "embed-search",
}


# NATS user names no upstream publisher may take, in any case: kbmesh's own users. A second
# user of one name makes nats-server refuse the whole configuration, and with it every later
# change (a revocation included).
RESERVED_NAMES = frozenset({*ROLES, *DEPLOY_USERS.values()})

# What an upstream system may publish, and the status it may follow.
UPSTREAM_PUBLISH = (
    Subject.DOC_UPLOADED,
    Subject.OCR_DONE,
    Subject.TAGS_CHANGED,
    Subject.DOC_DELETED,
)
UPSTREAM_STATUS = (Subject.DOC_INDEXED, Subject.DOC_FAILED)
UPSTREAM_TOKEN = "upstream"


class BusNotSetUp(RuntimeError):
    """What a service finds missing or different on the bus: streams, buckets and durable
    consumers are the operator's to set up (`kbmesh bus setup`), never a service's."""

    def __str__(self) -> str:
        return (
            f"the bus is not set up for this kbmesh: {self.args[0]}; run `kbmesh bus setup` "
            "as the operator's NATS user with the same KBMESH_BUS__* settings "
            '(docs/operations.md, "Bus credentials")'
        )


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str


@dataclass(frozen=True)
class Publisher:
    """An upstream system allowed to publish events for one org."""

    name: str
    org_id: str


# The publisher of the event a handler is working on (None: kbmesh's own services), set by
# the bus's `consume` while the handler runs, for the services that record who wrote what.
CURRENT_PUBLISHER: contextvars.ContextVar[Publisher | None] = contextvars.ContextVar(
    "kbmesh_publisher", default=None
)


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # May answer requests it received (the search service's replies).
    responses: bool = False
    # Publishes refused although `publish` matches them (nats-server: deny wins): the reads
    # of the private buckets this role may not read.
    deny: tuple[str, ...] = ()

    def __or__(self, other: Permissions) -> Permissions:
        return Permissions(
            tuple(dict.fromkeys(self.publish + other.publish)),
            tuple(dict.fromkeys(self.subscribe + other.subscribe)),
            self.responses or other.responses,
            # Services in one process: what any of them may do, the process may.
            tuple(s for s in self.deny if s in other.deny),
        )

    def config(self) -> dict[str, Any]:
        publish: dict[str, Any] = {"allow": [str(s) for s in self.publish]}
        if self.deny:
            publish["deny"] = list(self.deny)
        block: dict[str, Any] = {
            "publish": publish,
            "subscribe": {"allow": [str(s) for s in self.subscribe]},
        }
        if self.responses:
            block["allow_responses"] = True
        return block


def inbox_prefix(user: str) -> str:
    """Each user's replies arrive under its own prefix, so no user reads another's replies
    (a key record fetched by the operator, a document text fetched by search)."""
    return f"_INBOX.{user}"


def upstream_subject(subject: str, publisher: Publisher) -> str:
    """Where an upstream publisher's `subject` arrives inside kbmesh's account."""
    return f"{subject}.{UPSTREAM_TOKEN}.{publisher.org_id}.{publisher.name}"


def upstream_filter(subject: str) -> str:
    """The consumer filter for every publisher's `subject`."""
    return f"{subject}.{UPSTREAM_TOKEN}.*.*"


def status_subject(org_id: str, subject: str) -> str:
    """Where an org's status notifications are repeated for its upstream publishers."""
    return f"{UPSTREAM_TOKEN}.{org_id}.{subject}"


def publisher_of(msg: Any) -> Publisher | None:
    """The upstream publisher that sent `msg` (a NATS message, or its subject), or None when
    kbmesh's own services did.

    The identity is unforgeable: only the server's import of a publisher's account produces
    these subjects, and no kbmesh user but the operator and the gateway (replaying dead
    letters) may publish them."""
    subject: str = msg if isinstance(msg, str) else msg.subject
    parts = subject.split(".")
    if len(parts) != 5 or parts[2] != UPSTREAM_TOKEN:
        return None
    return Publisher(name=parts[4], org_id=parts[3])


# --- what each role does: the one table permissions and the topology come from -------------


@dataclass(frozen=True)
class Consumer:
    """A durable pull consumer of kbmesh's work stream, or of the upstream publishers'
    stream. The topology step creates it (with the ack wait and delivery limit `consume`
    counts on); only its role pulls from it and acknowledges what it pulled, and no service
    may change it."""

    durable: str
    subject: str  # its filter
    stream: str = STREAM


def consumers(subject: str, durable: str, *, upstream: bool = False) -> tuple[Consumer, ...]:
    """`durable` on `subject`, and with `upstream` its twin `<durable>-upstream` on every
    upstream publisher's `subject`."""
    own = Consumer(durable, subject)
    if not upstream:
        return (own,)
    return own, Consumer(f"{durable}-upstream", upstream_filter(subject), UPSTREAM_STREAM)


@dataclass(frozen=True)
class Work:
    """What one service does on the bus. Its NATS permissions are derived from this alone,
    and the durable consumers the topology step creates are the `consumes` of all roles."""

    consumes: tuple[Consumer, ...] = ()
    # Subjects it publishes: events, notifications, requests it sends.
    publishes: tuple[str, ...] = ()
    # Status notifications it repeats to each org's upstream publishers.
    notifies: tuple[str, ...] = ()
    # Requests it answers (in a queue group), and core subjects it follows.
    answers: tuple[str, ...] = ()
    listens: tuple[str, ...] = ()
    # KV buckets it writes (every service reads all but the private ones), and whether it
    # writes the texts.
    writes: tuple[str, ...] = ()
    # Private buckets (`PRIVATE_BUCKETS`) it reads without writing them.
    reads: tuple[str, ...] = ()
    writes_texts: bool = False
    # The kinds of audit entry it records (for every org: it serves them all).
    audits: tuple[AuditKind, ...] = ()
    # Listing dead letters (a short-lived reader consumer on the dead-letter stream, picking
    # one org's by subject), and replaying or discarding one, which removes it (the gateway's
    # dead-letter API).
    manages_dead_letters: bool = False


_REQUESTS = (Subject.SEARCH_QUERY, Subject.SEARCH_CHUNK, Subject.SEARCH_ASK)
# The export of vectors is a request too, which only the operator (`kbmesh backup`) may ask.
_EVENTS = tuple(s for s in Subject if s not in (*_REQUESTS, Subject.VECTORS_EXPORT))

WORK: dict[str, Work] = {
    "ingest": Work(
        consumes=(
            *consumers(Subject.DOC_UPLOADED, "ingest-doc-uploaded", upstream=True),
            *consumers(Subject.OCR_DONE, "ingest-ocr-done", upstream=True),
            *consumers(Subject.TAGS_CHANGED, "ingest-tags-changed", upstream=True),
            *consumers(Subject.DOC_DELETED, "ingest-doc-deleted", upstream=True),
            *consumers(Subject.KB_CHANGED, "ingest-kb-changed"),
            *consumers(Subject.DOC_FAILED, "ingest-doc-failed"),
        ),
        publishes=(Subject.KB_INDEX, Subject.KB_REMOVE, Subject.DOC_FAILED),
        notifies=(Subject.DOC_FAILED,),
        writes=("documents",),
        writes_texts=True,
        # Ingest applies every document change, whoever sent it.
        audits=("document",),
    ),
    "embed": Work(
        consumes=(
            *consumers(Subject.KB_INDEX, "embed-kb-index"),
            *consumers(Subject.KB_REMOVE, "embed-kb-remove"),
            *consumers(Subject.KB_CHANGED, "embed-kb-changed"),
        ),
        publishes=(Subject.DOC_INDEXED, Subject.DOC_FAILED),
        notifies=(Subject.DOC_INDEXED, Subject.DOC_FAILED),
        # A KB's vectors, for the operator's backup.
        answers=(Subject.VECTORS_EXPORT,),
        writes=("index", "kbs"),
    ),
    # Replies only.
    "search": Work(answers=_REQUESTS),
    "gateway": Work(
        publishes=(
            # Its own events, and any stream subject a replayed dead letter came from.
            *_EVENTS,
            *(upstream_filter(s) for s in UPSTREAM_PUBLISH),
            *_REQUESTS,
        ),
        listens=(
            Subject.DOC_INDEXED,
            Subject.DOC_FAILED,
            Subject.KB_CHANGED,
            Subject.SOURCE_RUN,
            "$KV.kbs.>",
        ),
        # Sources' definitions and their secrets are managed through the API; a sync asked
        # for is `state.requested`, set by compare-and-set.
        writes=("kbs", "documents", "prompts", SOURCES_BUCKET, SOURCE_SECRETS_BUCKET),
        writes_texts=True,
        # KB and source entries (document entries are ingest's, key entries the operator's),
        # refused webhook calls among them.
        audits=("kb", "source"),
        manages_dead_letters=True,
    ),
    # An upstream publisher inside kbmesh: it reads git repositories and web sites and sends
    # their documents as any upstream system would, staging bytes in the object store.
    "sources": Work(
        consumes=consumers(Subject.SOURCE_SYNC, "sources-source-sync"),
        publishes=(Subject.DOC_UPLOADED, Subject.DOC_DELETED, Subject.SOURCE_RUN),
        writes=(SOURCES_BUCKET,),
        reads=(SOURCE_SECRETS_BUCKET,),
        writes_texts=True,
    ),
}

# Buckets only the roles that name them in `Work.reads` / `Work.writes` may read.
PRIVATE_BUCKETS = (SOURCE_SECRETS_BUCKET,)

# Every durable consumer of the work stream, created by the topology step.
DURABLE_CONSUMERS: tuple[Consumer, ...] = tuple(c for w in WORK.values() for c in w.consumes)

# Reads, open to every service: stream and consumer state, messages by sequence or subject.
# Administration — creating, changing, purging or deleting streams, buckets, the object store
# and durable consumers — is the operator's (`Bus.connect(administer=True)`).
_JS_READ = (
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.*",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.MSG.GET.*",
    "$JS.API.DIRECT.GET.>",
    "$JS.API.CONSUMER.INFO.*.*",
    "$JS.API.CONSUMER.LIST.*",
    "$JS.API.CONSUMER.NAMES.*",
    "$JS.FC.>",
)


def _ephemeral_reads(hidden: tuple[str, ...]) -> tuple[str, ...]:
    """KV watches and object reads are ephemeral consumers, created on the legacy subject
    that names the stream only: the server refuses a durable name there. Only the buckets
    and the object store, which hold no durable consumer (a name given on that subject
    would otherwise change one), less the `hidden` buckets."""
    streams = (*(f"KV_{b}" for b in KV_BUCKETS if b not in hidden), f"OBJ_{OBJECT_STORE}")
    return tuple(f"$JS.API.CONSUMER.CREATE.{s}" for s in streams)


def private_reads(bucket: str) -> tuple[str, ...]:
    """Every request that reads a value of `bucket`: direct gets (by key or by sequence),
    the stream's message get, and consumers of any form on its stream (watches)."""
    stream = f"KV_{bucket}"
    return (
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>",
    )


def _derive(work: Work, inbox: str) -> Permissions:
    hidden = tuple(b for b in PRIVATE_BUCKETS if b not in work.reads + work.writes)
    publish: list[str] = [*_JS_READ, *_ephemeral_reads(hidden)]
    for consumer in work.consumes:
        publish += (
            f"$JS.API.CONSUMER.MSG.NEXT.{consumer.stream}.{consumer.durable}",
            f"$JS.ACK.{consumer.stream}.{consumer.durable}.>",
        )
    if work.consumes:
        publish.append("dlq.>")  # what it cannot handle
    publish += work.publishes
    publish += (status_subject("*", s) for s in work.notifies)
    publish += (f"$KV.{b}.>" for b in work.writes)
    if work.writes_texts:
        # A replaced or deleted object's chunks are purged from its stream.
        publish += (f"$O.{OBJECT_STORE}.>", f"$JS.API.STREAM.PURGE.OBJ_{OBJECT_STORE}")
    publish += (audit_subject("*", kind) for kind in work.audits)
    if work.manages_dead_letters:
        # The readers of deadletters.list_dead_letters: created (with one filter subject or
        # several), pulled from and deleted. The dead-letter stream holds no durable consumer
        # of kbmesh's work, so this changes none.
        publish += (
            f"$JS.API.CONSUMER.CREATE.{DLQ_STREAM}.*",
            f"$JS.API.CONSUMER.CREATE.{DLQ_STREAM}.*.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{DLQ_STREAM}.*",
            f"$JS.API.CONSUMER.DELETE.{DLQ_STREAM}.*",
            f"$JS.API.STREAM.MSG.DELETE.{DLQ_STREAM}",
        )
    return Permissions(
        tuple(dict.fromkeys(str(p) for p in publish)),
        (inbox, *work.answers, *work.listens),
        responses=bool(work.answers),
        deny=tuple(s for b in hidden for s in private_reads(b)),
    )


def permissions(role: str, user: str | None = None) -> Permissions:
    """What `role` may publish and subscribe to, for the NATS user `user` (default: the
    role's name; it names the user's reply inbox)."""
    inbox = f"{inbox_prefix(user or role)}.>"
    if "+" in role:  # services sharing one process
        parts = [permissions(part, user or role) for part in role.split("+")]
        return functools.reduce(operator.or_, parts)
    if role == "operator":
        return Permissions((">",), (">",), responses=True)
    if role == "stack":
        return permissions("+".join(SERVICE_ROLES), user or role)
    if role not in WORK:
        raise ValueError(f"unknown bus role {role!r}; choose from {', '.join(ROLES)}")
    return _derive(WORK[role], inbox)


def role_for(services: Iterable[str]) -> str:
    """The role a process running `services` needs: one service's, `stack` for all five,
    else the services joined by `+` (the union of their permissions)."""
    chosen = sorted(set(services), key=SERVICE_ROLES.index)
    if len(chosen) == len(SERVICE_ROLES):
        return "stack"
    return "+".join(chosen)


# --- server configuration ---------------------------------------------------------------


@dataclass
class PublisherRecord:
    name: str
    org_id: str
    password: str
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    @property
    def publisher(self) -> Publisher:
        return Publisher(self.name, self.org_id)

    def summary(self) -> dict[str, str]:
        return {"name": self.name, "org_id": self.org_id, "created_at": self.created_at}


def check_publisher_name(name: str) -> str:
    """`name` if an upstream publisher may have it: a plain id (a valid NATS user name) that
    is no kbmesh user's; InvalidInput otherwise."""
    check_id(name, "NAME")
    if name.lower() in RESERVED_NAMES:
        raise InvalidInput(
            f"NAME {name!r} is reserved: kbmesh's own NATS users are "
            + ", ".join(sorted(RESERVED_NAMES))
            + "; choose another name",
            field="NAME",
        )
    return name


def server_accounts(
    users: dict[str, Credentials], publishers: Iterable[PublisherRecord] = ()
) -> dict[str, Any]:
    """The `accounts` block of nats-server's configuration: kbmesh's account with one user
    per role in `users`, and one account per upstream publisher. A publisher named like a
    user is refused (ValueError): the server would refuse the whole configuration."""
    exports: list[dict[str, Any]] = []
    accounts: dict[str, Any] = {}
    taken = {c.user.lower() for c in users.values()}
    for record in publishers:
        if record.name.lower() in taken:
            raise ValueError(f"publisher {record.name!r} has the name of a kbmesh NATS user")
        taken.add(record.name.lower())
        account = PUBLISHER_ACCOUNT_PREFIX + record.name
        imports: list[dict[str, Any]] = []
        for subject in UPSTREAM_PUBLISH:
            inside = upstream_subject(subject, record.publisher)
            # A service import: the stream's acknowledgement travels back to the publisher.
            # Each export names the one account that may import it.
            exports.append({"service": inside, "accounts": [account]})
            imports.append({"service": {"account": ACCOUNT, "subject": inside}, "to": str(subject)})
        for subject in UPSTREAM_STATUS:
            inside = status_subject(record.org_id, subject)
            exports.append({"stream": inside, "accounts": [account]})
            imports.append({"stream": {"account": ACCOUNT, "subject": inside}, "to": str(subject)})
        accounts[account] = {
            "users": [{"user": record.name, "password": record.password}],
            "imports": imports,
        }
    kbmesh: dict[str, Any] = {
        "jetstream": "enabled",
        "users": [
            {
                "user": creds.user,
                "password": creds.password,
                "permissions": permissions(role, creds.user).config(),
            }
            for role, creds in users.items()
        ],
    }
    if exports:
        kbmesh["exports"] = exports
    return {ACCOUNT: kbmesh, **accounts}


# --- the data directory's credentials -----------------------------------------------------


def new_password() -> str:
    return secrets.token_urlsafe(32)


def local_credentials(data_dir: Path) -> dict[str, Credentials]:
    """The credentials `kbmesh up` uses on `data_dir`, created (0600) on first use."""
    path = data_dir / CREDENTIALS_FILE
    if path.exists():
        stored = json.loads(path.read_text())
        users = {role: Credentials(**stored[role]) for role in ROLES if role in stored}
        if set(users) == set(ROLES):
            return users
    users = {role: Credentials(role, new_password()) for role in ROLES}
    write_private(
        path, json.dumps({r: {"user": c.user, "password": c.password} for r, c in users.items()})
    )
    return users


def recorded_credentials(data_dir: Path, role: str) -> Credentials | None:
    """The credentials of `role` that a `kbmesh up` on `data_dir` created, if any."""
    path = data_dir / CREDENTIALS_FILE
    if not path.exists():
        return None
    found = json.loads(path.read_text()).get(role)
    return Credentials(**found) if found else None


def load_publishers(data_dir: Path) -> list[PublisherRecord]:
    path = data_dir / PUBLISHERS_FILE
    if not path.exists():
        return []
    return [PublisherRecord(**p) for p in json.loads(path.read_text())]


def save_publishers(data_dir: Path, records: list[PublisherRecord]) -> None:
    write_private(data_dir / PUBLISHERS_FILE, json.dumps([r.__dict__ for r in records], indent=1))


def add_publisher(data_dir: Path, name: str, org_id: str) -> PublisherRecord:
    check_publisher_name(name)
    check_id(org_id, "--org")
    records = load_publishers(data_dir)
    if any(r.name == name for r in records):
        raise ValueError(f"a publisher named {name!r} exists; revoke it first")
    record = PublisherRecord(name=name, org_id=org_id, password=new_password())
    save_publishers(data_dir, [*records, record])
    return record


def revoke_publisher(data_dir: Path, name: str) -> PublisherRecord | None:
    """Remove the publisher `name` from the data directory: its record, or None if none."""
    records = load_publishers(data_dir)
    removed = next((r for r in records if r.name == name), None)
    if removed is not None:
        save_publishers(data_dir, [r for r in records if r is not removed])
    return removed


def local_accounts(data_dir: Path) -> dict[str, Any]:
    """The accounts of `kbmesh up`'s private server on `data_dir`, as they stand now. A
    publisher recorded under a reserved name (by a kbmesh that did not refuse it) is left
    out, so that the server starts and takes changes; revoking it removes the record."""
    publishers = []
    for record in load_publishers(data_dir):
        try:
            check_publisher_name(record.name)
        except InvalidInput as err:
            log.error("publisher_ignored name=%s reason=%s", record.name, err)
            continue
        publishers.append(record)
    return server_accounts(local_credentials(data_dir), publishers)


async def admits(url: str, user: str, password: str) -> bool:
    """Whether the server at `url` admits `user` with `password` now: the proof that a
    publisher added is usable, and one revoked is shut out."""

    async def quiet(err: Exception) -> None:
        pass  # the refusal is the answer, reported by the caller

    try:
        nc = await nats.connect(
            url,
            user=user,
            password=password,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=5,
            error_cb=quiet,
        )
    except nats.errors.Error as err:
        if "authorization violation" in str(err).lower():
            return False
        raise
    await nc.close()
    return True


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Files and folders created meanwhile are the owner's only (0600/0700)."""
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


# --- deploy/: the same users, passwords from the environment ------------------------------


class EnvRef(str):
    """A value nats-server reads from its environment (`$NAME` in its configuration)."""


def password_variable(user: str) -> str:
    """The nats-server environment variable holding `user`'s password in `deploy/`."""
    return "NATS_PASSWORD_" + user.upper().replace("-", "_")


def deploy_accounts(publishers: Iterable[Publisher] = ()) -> dict[str, Any]:
    """The accounts of `deploy/`'s NATS: `DEPLOY_USERS` and `publishers`, every password an
    environment reference."""
    users = {
        role: Credentials(user, EnvRef(password_variable(user)))
        for role, user in DEPLOY_USERS.items()
    }
    records = [
        PublisherRecord(p.name, p.org_id, EnvRef(password_variable(p.name)), "") for p in publishers
    ]
    return server_accounts(users, records)


def render_conf(value: Any, indent: int = 0) -> str:
    """`value` in nats-server's configuration syntax; `EnvRef`s stay variable references."""
    pad = "  " * (indent + 1)
    if isinstance(value, EnvRef):
        return f"${value}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        body = "".join(f"{pad}{k}: {render_conf(v, indent + 1)}\n" for k, v in value.items())
        return "{\n" + body + "  " * indent + "}"
    if isinstance(value, list):
        body = "".join(f"{pad}{render_conf(v, indent + 1)}\n" for v in value)
        return "[\n" + body + "  " * indent + "]"
    return str(value)


def deploy_helm_accounts(publishers: Iterable[Publisher] = ()) -> str:
    """The same accounts as YAML for the NATS Helm chart's `config.merge.accounts`
    (deploy/kubernetes/helm/nats-values.yaml), each password `<< $VAR >>`: the chart's
    spelling of an environment reference."""
    import yaml  # only this command needs it

    def helm(value: Any) -> Any:
        if isinstance(value, EnvRef):
            return f"<< ${value} >>"
        if isinstance(value, dict):
            return {k: helm(v) for k, v in value.items()}
        if isinstance(value, list):
            return [helm(v) for v in value]
        return value

    text = yaml.safe_dump(helm(deploy_accounts(publishers)), sort_keys=False, width=200)
    # The chart reads `<< $VAR >>` unquoted only.
    return re.sub(r"'(<< \$\w+ >>)'", r"\1", text)


def deploy_conf(publishers: Iterable[Publisher] = ()) -> str:
    """deploy/nats/auth.conf: what `kbmesh bus config` prints."""
    return (
        "# kbmesh's NATS users and their permissions (services/common/bus/auth.py),\n"
        "# written by `kbmesh bus config [--publisher NAME:ORG ...]`; do not edit by hand.\n"
        "# nats-server reads each password from its environment: "
        + ", ".join(password_variable(u) for u in DEPLOY_USERS.values())
        + ".\n"
        "accounts: " + render_conf(deploy_accounts(publishers)) + "\n"
    )
