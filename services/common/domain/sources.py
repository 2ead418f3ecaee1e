"""Sources: git repositories and web sites that kbmesh keeps a KB in sync with.

The records here are shared by the gateway (which manages definitions and secrets and starts
runs on request or on a verified webhook) and the sources service (which runs them on their
schedule and publishes the documents as an upstream system would). Stored in the `sources`
KV bucket: the definition under `<org>.<source>`, its sync state under `<org>.<source>.state`
and the lease of the replica running it under `<org>.<source>.lease`; secrets (a git token or
key, the webhook secret) live apart, in `source-secrets`, which the API never echoes back.

A document's id is derived from its source and uri (`document_id_for`), so a re-run finds the
same documents: an unchanged file is the same document with the same checksum (nothing to
embed), a changed one a new revision, a deleted one a `doc.deleted` of that id.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime, timedelta
from typing import Literal

from croniter import croniter
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.common.domain.ids import ID_PATTERN
from services.common.domain.models import utcnow

SourceKind = Literal["git", "web"]
RunTrigger = Literal["schedule", "manual", "hook"]
RunStatus = Literal["running", "succeeded", "failed"]

# Runs a source's state keeps, newest last.
RUN_HISTORY = 20
# The shortest interval a schedule may have: a run of a large source takes longer.
MIN_INTERVAL = timedelta(minutes=1)
DEFAULT_SCHEDULE = "1h"
_INTERVAL = re.compile(r"^(\d+)\s*([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_schedule(schedule: str) -> str:
    """`schedule` if it is an interval (`30m`, `1h`, `1d`; at least a minute) or a five-field
    cron expression (`*/15 * * * *`); ValueError naming the forms otherwise."""
    value = schedule.strip()
    match = _INTERVAL.match(value)
    if match:
        every = timedelta(**{_UNITS[match[2]]: int(match[1])})
        if every < MIN_INTERVAL:
            raise ValueError(f"schedule {schedule!r} is shorter than a minute")
        return value
    if len(value.split()) == 5 and croniter.is_valid(value):
        return value
    raise ValueError(
        f"schedule {schedule!r} is neither an interval (30m, 1h, 1d) nor a five-field cron "
        "expression (*/15 * * * *)"
    )


def next_run(schedule: str, after: datetime) -> datetime:
    """When a source on `schedule` runs next after `after` (a run's start, UTC)."""
    match = _INTERVAL.match(schedule.strip())
    if match:
        return after + timedelta(**{_UNITS[match[2]]: int(match[1])})
    nxt: datetime = croniter(schedule, after).get_next(datetime)
    return nxt


def document_id_for(source_id: str, uri: str) -> str:
    """The id of the document a source holds at `uri` (a file path, a canonical URL): the
    same on every run and every replica."""
    digest = hashlib.sha256(f"{source_id}\0{uri}".encode()).hexdigest()
    return f"src-{digest[:40]}"


class SourceSpec(BaseModel):
    """What a client sets: the source's definition (REST body, MCP tool input, `kbmesh
    sources apply` YAML entry). Fields of the other kind are refused."""

    model_config = ConfigDict(extra="forbid")

    kind: SourceKind = Field(
        description="git: a repository, synced commit by commit; web: a site, crawled"
    )
    kb: str = Field(min_length=1, max_length=200, description="the KB it feeds: id or name")
    url: str = Field(
        min_length=1,
        max_length=2000,
        description="git: the remote (https://, ssh://, git://, or a local path for "
        "operators); web: the start URL",
    )
    name: str | None = Field(None, max_length=200, description="a label; defaults to the url")
    tags: list[str] = Field(default_factory=list, description="tags its documents get")
    collection: str | None = Field(None, description="the collection its documents are in")
    schedule: str = Field(
        DEFAULT_SCHEDULE, description="an interval (30m, 1h, 1d) or a cron expression"
    )
    enabled: bool = Field(True, description="false: its schedule is paused")
    include: list[str] = Field(
        default_factory=list,
        description="git: path globs (`docs/**`, `*.md`); web: URL globs; empty: everything",
    )
    exclude: list[str] = Field(default_factory=list, description="globs left out")
    # git
    branch: str | None = Field(
        None, max_length=255, description="git: branch or tag (default: the remote's HEAD)"
    )
    # web
    sitemap: str | None = Field(None, max_length=2000, description="web: a sitemap.xml URL")
    start_urls: list[str] = Field(default_factory=list, description="web: more start URLs")
    scope: str | None = Field(
        None,
        max_length=2000,
        description="web: the URL prefix pages must start with (default: the start URL's "
        "host and directory)",
    )
    max_depth: int | None = Field(None, ge=0, le=50, description="web: link depth (default 10)")
    max_pages: int | None = Field(
        None, ge=1, le=100_000, description="web: pages per run (default 2000)"
    )
    rate: float | None = Field(
        None, gt=0, le=100, description="web: requests per second per host (default 4)"
    )
    removal_grace: str | None = Field(
        None,
        description="web: how long a page must be gone (404/410, out of the sitemap) before "
        "its document is deleted, as an interval (default 0s: at once)",
    )

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: str) -> str:
        return parse_schedule(value)

    @model_validator(mode="after")
    def _fields_of_kind(self) -> SourceSpec:
        git_only = {"branch": self.branch}
        web_only = {
            "sitemap": self.sitemap,
            "start_urls": self.start_urls or None,
            "scope": self.scope,
            "max_depth": self.max_depth,
            "max_pages": self.max_pages,
            "rate": self.rate,
            "removal_grace": self.removal_grace,
        }
        wrong = git_only if self.kind == "web" else web_only
        named = sorted(k for k, v in wrong.items() if v is not None)
        if named:
            raise ValueError(f"{', '.join(named)} do not apply to a {self.kind} source")
        return self


class SourceSecrets(BaseModel):
    """What a source needs and no client reads back: git credentials (a token for https, a
    private key for ssh) and the webhook's secret (its HMAC key and token)."""

    token: str | None = None
    ssh_key: str | None = None
    webhook_secret: str


class Source(SourceSpec):
    """A stored source: the definition with its ids, the KB it resolved to, who wrote it."""

    model_config = ConfigDict(extra="ignore")

    org_id: str
    source_id: str = Field(pattern=ID_PATTERN)
    kb_id: str = Field(pattern=ID_PATTERN)
    has_credentials: bool = False
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)

    @property
    def key(self) -> str:
        return f"{self.org_id}.{self.source_id}"


class SourceRun(BaseModel):
    """One run of a source: what it found and what it did. `unchanged` counts files or pages
    the run saw and sent nothing for (a 304, the same blob)."""

    run_id: str
    trigger: RunTrigger
    status: RunStatus = "running"
    started_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime | None = None
    revision: str | None = Field(None, description="git: the commit synced to")
    added: int = 0
    changed: int = 0
    unchanged: int = 0
    deleted: int = 0
    failed: int = 0
    requests: int = 0
    bytes_read: int = 0
    error: str | None = None

    @property
    def duration_seconds(self) -> float | None:
        if self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()


class SourcePlacement(BaseModel):
    """Where a source's documents go: its KB, tags and collection. The state keeps the one
    its documents were last sent with, because a run sends only what changed at the source:
    when the definition's placement differs from it, the next run sends every document
    again, placed anew."""

    kb_id: str
    tags: list[str] = Field(default_factory=list)
    collection: str | None = None

    @classmethod
    def of(cls, source: Source) -> SourcePlacement:
        return cls(kb_id=source.kb_id, tags=list(source.tags), collection=source.collection)

    def digest(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


class SourceState(BaseModel):
    """Where a source's sync stands, written by the sources service only. `cursor` is what the
    next run continues from: the last commit synced (git) or the object holding each page's
    validators (web). It advances only when every document of the run is published, so a run
    killed halfway is done again from the same place (the same document ids: nothing doubled,
    nothing lost)."""

    org_id: str
    source_id: str
    cursor: str | None = None
    last_run: SourceRun | None = None
    next_run_at: datetime | None = None
    runs: list[SourceRun] = Field(default_factory=list, description="newest last")
    # A sync asked for (manual or by webhook) that no run has taken yet.
    requested: RunTrigger | None = None
    # Where the documents were sent by the last successful run (None: not recorded yet).
    placement: SourcePlacement | None = None

    @property
    def key(self) -> str:
        return f"{self.org_id}.{self.source_id}.state"

    def finished(self, run: SourceRun) -> None:
        self.last_run = run
        self.runs = [r for r in self.runs if r.run_id != run.run_id]
        self.runs.append(run)
        del self.runs[:-RUN_HISTORY]


class SourceLease(BaseModel):
    """Which replica runs a source until when: taken and renewed by compare-and-set, so one
    replica at a time runs it; a lease not renewed in time (its holder died) is taken over."""

    holder: str
    run_id: str
    expires_at: datetime
