"""Who may do what on the bus: one NATS user per kbmesh role, each with the least permissions
its work needs, and upstream publishers bound to one org each.

The model is data (`permissions(role)`), rendered into nats-server configuration by
`server_accounts()`: `kbmesh up` writes it for its private server, and `deploy/` ships the
same rendering with passwords taken from the environment (`kbmesh bus config`).

- All of kbmesh lives in one NATS account, `KBMESH`, with JetStream. Roles: `operator` (the
  CLI: API keys, dead letters, backups; everything in the account, and the only user that
  may ask embed for a KB's vectors, `vectors.export`), `ingest`, `embed`, `search`,
  `gateway`, and `stack`, the four services together as `kbmesh up` runs them in one
  process. Only `operator` may write the API-key bucket (`keys`); the others read it.
- Each upstream publisher has an account of its own holding one user. It sees four
  subjects, `doc.uploaded`, `ocr.done`, `tags.changed`, `doc.deleted`, imported from
  `KBMESH` where they arrive as `<subject>.upstream.<org>.<publisher>`: the server writes
  the publisher's name and org into the subject, so no publisher can claim another. Ingest
  refuses (dead-letters) an event whose `org_id` is not the org of its subject. Its status
  notifications, `doc.indexed` and `doc.failed`, come from `upstream.<org>.<subject>`: its
  own org's only.
- Data directory files holding secrets are written 0600 (`files.write_private`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.common.domain.ids import check_id
from services.common.messages.events import DLQ_STREAM, STREAM, Subject
from services.common.messages.names import (
    AUDIT_PREFIX,
    AUDIT_STREAM,
    KEYS_BUCKET,
    KV_BUCKETS,
    OBJECT_STORE,
)
from services.common.ops.files import write_private

ACCOUNT = "KBMESH"
PUBLISHER_ACCOUNT_PREFIX = "PUB_"
SERVICE_ROLES = ("ingest", "embed", "search", "gateway")
ROLES = ("operator", "stack", *SERVICE_ROLES)
CREDENTIALS_FILE = "nats-credentials.json"
PUBLISHERS_FILE = "nats-publishers.json"

# What an upstream system may publish, and the status it may follow.
UPSTREAM_PUBLISH = (
    Subject.DOC_UPLOADED,
    Subject.OCR_DONE,
    Subject.TAGS_CHANGED,
    Subject.DOC_DELETED,
)
UPSTREAM_STATUS = (Subject.DOC_INDEXED, Subject.DOC_FAILED)
UPSTREAM_TOKEN = "upstream"


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

    def __or__(self, other: Permissions) -> Permissions:
        return Permissions(
            tuple(dict.fromkeys(self.publish + other.publish)),
            tuple(dict.fromkeys(self.subscribe + other.subscribe)),
            self.responses or other.responses,
        )

    def config(self) -> dict[str, Any]:
        block: dict[str, Any] = {
            "publish": {"allow": [str(s) for s in self.publish]},
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


# --- the permission model -------------------------------------------------------------

_JS_READ = (
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.*",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.MSG.GET.*",
    "$JS.API.DIRECT.GET.>",
    # Consumers read; creating one (a KV watch, a pull consumer) writes no data.
    "$JS.API.CONSUMER.>",
    "$JS.ACK.>",
    "$JS.FC.>",
)
# Request/reply subjects, never in the event stream: searches, which the gateway asks, and
# the export of vectors, which only the operator (`kbmesh backup`) may ask.
_REQUESTS = (Subject.SEARCH_QUERY, Subject.SEARCH_CHUNK, Subject.SEARCH_ASK)
_EVENTS = tuple(s for s in Subject if s not in (*_REQUESTS, Subject.VECTORS_EXPORT))


def _streams(buckets: Iterable[str], object_store: str) -> tuple[str, ...]:

    return (
        STREAM,
        DLQ_STREAM,
        AUDIT_STREAM,
        *(f"KV_{b}" for b in buckets if b != KEYS_BUCKET),
        f"OBJ_{object_store}",
    )


def _topology() -> tuple[str, ...]:
    """Every service declares the topology when it connects (any may start first). The key
    bucket may be created (empty) but never changed, purged or written but by the operator."""

    managed = _streams(KV_BUCKETS, OBJECT_STORE)
    return (
        *(f"$JS.API.STREAM.{op}.{s}" for s in managed for op in ("CREATE", "UPDATE")),
        f"$JS.API.STREAM.CREATE.KV_{KEYS_BUCKET}",
    )


def _texts_write() -> tuple[str, ...]:

    # A replaced or deleted object's chunks are purged from its stream.
    return (f"$O.{OBJECT_STORE}.>", f"$JS.API.STREAM.PURGE.OBJ_{OBJECT_STORE}")


def _kv(*buckets: str) -> tuple[str, ...]:
    return tuple(f"$KV.{b}.>" for b in buckets)


def _audit(kind: str) -> str:

    return f"{AUDIT_PREFIX}*.{kind}"


def _status_fanout(*subjects: str) -> tuple[str, ...]:
    return tuple(status_subject("*", s) for s in subjects)


def permissions(role: str, user: str | None = None) -> Permissions:
    """What `role` may publish and subscribe to, for the NATS user `user` (default: the
    role's name; it names the user's reply inbox)."""
    inbox = (f"{inbox_prefix(user or role)}.>",)
    if "+" in role:  # services sharing one process
        combined = Permissions((), inbox)
        for part in role.split("+"):
            combined = combined | permissions(part, user or role)
        return combined
    if role == "operator":
        return Permissions((">",), (">",), responses=True)
    if role == "stack":
        combined = Permissions((), inbox)
        for service in SERVICE_ROLES:
            combined = combined | permissions(service, user or role)
        return combined
    base = Permissions(_JS_READ + _topology(), inbox)
    if role == "ingest":
        return base | Permissions(
            (
                Subject.KB_INDEX,
                Subject.KB_REMOVE,
                Subject.DOC_FAILED,
                *_status_fanout(Subject.DOC_FAILED),
                "dlq.>",
                *_kv("documents"),
                *_texts_write(),
                # The audit trail of documents: ingest applies every change, whoever sent it.
                _audit("document"),
            ),
            (),
        )
    if role == "embed":
        return base | Permissions(
            (
                Subject.DOC_INDEXED,
                Subject.DOC_FAILED,
                *_status_fanout(Subject.DOC_INDEXED, Subject.DOC_FAILED),
                "dlq.>",
                *_kv("index", "kbs"),
            ),
            (Subject.VECTORS_EXPORT,),
            responses=True,
        )
    if role == "search":
        return base | Permissions((), _REQUESTS, responses=True)
    if role == "gateway":
        return base | Permissions(
            (
                # Its own events, and any stream subject a replayed dead letter came from.
                *_EVENTS,
                *(upstream_filter(s) for s in UPSTREAM_PUBLISH),
                *_REQUESTS,
                *_kv("kbs", "documents", "prompts"),
                *_texts_write(),
                # Replaying or discarding a dead letter removes it.
                f"$JS.API.STREAM.MSG.DELETE.{DLQ_STREAM}",
                # The audit trail of KBs (documents: ingest's; keys: the operator's).
                _audit("kb"),
            ),
            (Subject.DOC_INDEXED, Subject.DOC_FAILED, Subject.KB_CHANGED, "$KV.kbs.>"),
        )
    raise ValueError(f"unknown bus role {role!r}; choose from {', '.join(ROLES)}")


def role_for(services: Iterable[str]) -> str:
    """The role a process running `services` needs: one service's, `stack` for all four,
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


def server_accounts(
    users: dict[str, Credentials], publishers: Iterable[PublisherRecord] = ()
) -> dict[str, Any]:
    """The `accounts` block of nats-server's configuration: kbmesh's account with one user
    per role in `users`, and one account per upstream publisher."""
    exports: list[dict[str, Any]] = []
    accounts: dict[str, Any] = {}
    for record in publishers:
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
    check_id(name, "NAME")
    check_id(org_id, "--org")
    records = load_publishers(data_dir)
    if any(r.name == name for r in records):
        raise ValueError(f"a publisher named {name!r} exists; revoke it first")
    record = PublisherRecord(name=name, org_id=org_id, password=new_password())
    save_publishers(data_dir, [*records, record])
    return record


def revoke_publisher(data_dir: Path, name: str) -> bool:
    records = load_publishers(data_dir)
    kept = [r for r in records if r.name != name]
    if len(kept) == len(records):
        return False
    save_publishers(data_dir, kept)
    return True


def local_accounts(data_dir: Path) -> dict[str, Any]:
    """The accounts of `kbmesh up`'s private server on `data_dir`, as they stand now."""
    return server_accounts(local_credentials(data_dir), load_publishers(data_dir))


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Files and folders created meanwhile are the owner's only (0600/0700)."""
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


# --- deploy/: the same users, passwords from the environment ------------------------------

# The processes `deploy/` runs, by role → NATS user (`serve embed search` shares one).
DEPLOY_USERS = {
    "operator": "operator",
    "ingest": "ingest",
    "embed": "embed",
    "search": "search",
    "gateway": "gateway",
    "embed+search": "embed-search",
}


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
