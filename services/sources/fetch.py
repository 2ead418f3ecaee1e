"""What a fetcher tells the sources service: the one interface git repositories and web sites
are read through (git.py, web.py), so the run itself (service.py) knows neither.

A fetcher compares what a source holds now with the state the last complete run left
(opaque bytes: a commit id, the validators of every page) and yields one `Change` per
document: `Put` (new or changed content), `Unchanged`, `Gone` (deleted, renamed away, out of
the sitemap past its grace) or `Failed` (this one could not be read; the rest goes on). It
yields as it reads, so a run holds one document at a time, and ends with `Done`, which
carries the state the next run continues from. A fetcher raises `SourceError` when the
source as a whole cannot be read (clone refused, start URL gone): the run fails, says why,
and keeps every document it had.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.common.domain.sources import Source, SourceSecrets


class SourceError(Exception):
    """The source cannot be read as a whole; the message says why, for the run's record."""


@dataclass(frozen=True)
class Put:
    """A document to send: new, or changed since the last run."""

    uri: str  # a path inside the repository, or a page's canonical URL
    name: str  # the file's name, or the page's title
    content: bytes
    revision: str  # the blob id or commit, the ETag or Last-Modified, or a content digest
    mime_type: str | None = None  # None: ingest reads the type from the bytes and the name
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Unchanged:
    uri: str


@dataclass(frozen=True)
class Gone:
    uri: str


@dataclass(frozen=True)
class Failed:
    uri: str
    error: str


@dataclass(frozen=True)
class Done:
    """The end of a fetch: the state to continue from, and what reading cost."""

    state: bytes | None
    revision: str | None = None  # git: the commit now synced
    requests: int = 0
    bytes_read: int = 0
    # The changes named every document the source holds now (a first run, a full listing):
    # any other document of the source is gone, and the run deletes it.
    complete: bool = False


Change = Put | Unchanged | Gone | Failed


class Fetcher(Protocol):
    def fetch(
        self, source: Source, secrets: SourceSecrets | None, state: bytes | None
    ) -> AsyncIterator[Change | Done]:
        """Every change since `state` (None: the first run; everything is new), then `Done`.
        `Unchanged` may be left out for documents the fetcher did not look at (a git diff
        names only what changed); the run counts what the fetcher reports."""
        ...
