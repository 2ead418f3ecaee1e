"""`kbmesh ingest`: folders, files and web pages into a knowledge base, through the REST API
of a running kbmesh.

A file's document is found again by its `uri` (the path relative to the root given) within
the source, so a re-run updates the same documents. A file whose bytes hash to the stored
document's `content_checksum` is not uploaded again (and so nothing is re-embedded);
`--sync` deletes the source's documents whose files are gone. Every upload waits until the
document is indexed or failed.

Which files are uploaded follows the server: it lists the formats it reads (`GET /v1/types`),
and every file of those formats (also gzip-compressed), and every text file whatever its
name, is uploaded; the rest is skipped with the reason. A knowledge base that does not exist
is reported before anything else (`--create-kb` creates it). The last line printed is always
the summary `N uploaded, N unchanged, N deleted, N skipped, N failed`; exit status 1 when
anything failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import gzip
import hashlib
import json
import os
import sys
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import httpx
import rich.progress
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_result,
    stop_after_delay,
    wait_fixed,
)

from services.cli.login import credential
from services.common.domain.formats import FORMATS, GZIP_TYPE
from services.common.settings import ClientSettings


def default_api() -> str:
    """KBMESH_API_URL, else the local stack on KBMESH_PORT (8080), as `kbmesh up` serves it."""
    return ClientSettings().api


PAGE = 500
# How long to keep polling a document the upload's own wait gave up on (a long queue).
SETTLE_SECONDS = 3600.0
POLL_SECONDS = 1.0
PLAIN_EVERY_SECONDS = 5.0
TTY_EVERY_SECONDS = 0.2
SNIFF_BYTES = 8192
EXIT_USAGE = 2
EXIT_FAILED = 1


def add_parser(sub: Any) -> None:
    """Register `kbmesh ingest` on the CLI's subparsers."""
    p = sub.add_parser(
        "ingest",
        help="load files, folders or a web page into a knowledge base (of a running kbmesh)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH|URL", help="files, folders or http(s) URLs")
    p.add_argument("--kb", default="default", help="knowledge base name or id (default: default)")
    p.add_argument(
        "--create-kb",
        action="store_true",
        help="create the knowledge base (named --kb) when it does not exist",
    )
    p.add_argument("--tags", default="", help="comma-separated tags for every document")
    p.add_argument("--collection", help="the collection of every document")
    p.add_argument(
        "--source-id",
        help="provenance group of the documents (default: the name of the first folder); "
        "--sync works within it",
    )
    p.add_argument(
        "--include", action="append", default=[], metavar="GLOB", help="only matching paths"
    )
    p.add_argument(
        "--exclude", action="append", default=[], metavar="GLOB", help="skip matching paths"
    )
    p.add_argument(
        "--sync", action="store_true", help="delete the source's documents whose files are gone"
    )
    # Each upload waits until indexed: enough in flight to keep embed busy (and batching).
    p.add_argument("--concurrency", type=_positive, default=8, help="uploads at once (default 8)")
    p.add_argument(
        "--api",
        default=default_api(),
        help="kbmesh REST API (KBMESH_API_URL; default http://127.0.0.1:$KBMESH_PORT, port "
        "8080); the key comes from KBMESH_API_KEY",
    )


def run(args: argparse.Namespace) -> int:
    """Entry point from the CLI: returns the exit status."""
    try:
        options = Options.from_args(args)
    except UsageError as err:
        print(f"kbmesh ingest: {err}", file=sys.stderr)
        return EXIT_USAGE
    return asyncio.run(Ingest(options).run())


class UsageError(Exception):
    """Arguments that cannot work (exit status 2)."""


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


@dataclass
class Options:
    roots: list[Path]
    urls: list[str]
    kb: str
    tags: list[str]
    collection: str | None
    source_id: str
    include: list[str]
    exclude: list[str]
    sync: bool
    concurrency: int
    api: str
    api_key: str | None
    create_kb: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        urls = [p for p in args.paths if p.startswith(("http://", "https://"))]
        roots = [Path(p) for p in args.paths if p not in urls]
        for root in roots:
            if not root.exists():
                raise UsageError(f"{root}: no such file or folder")
        if args.sync and not roots:
            raise UsageError("--sync needs a folder or files to compare with")
        source_id = args.source_id or _default_source(roots)
        if not source_id:
            raise UsageError("give --source-id (no folder to name the source after)")
        return cls(
            roots=roots,
            urls=urls,
            kb=args.kb,
            tags=[t.strip() for t in args.tags.split(",") if t.strip()],
            collection=args.collection,
            source_id=source_id,
            include=args.include,
            exclude=args.exclude,
            sync=args.sync,
            concurrency=args.concurrency,
            api=args.api.rstrip("/"),
            api_key=credential(args.api),
            create_kb=bool(getattr(args, "create_kb", False)),
        )


def _default_source(roots: list[Path]) -> str:
    if not roots:
        return "web"
    root = roots[0].resolve()
    return (root if root.is_dir() else root.parent).name or "root"


# ---- walking --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalFile:
    path: Path
    uri: str
    mime_type: str
    size: int
    mtime: float


@dataclass(frozen=True)
class Skipped:
    uri: str
    reason: str


@dataclass(frozen=True)
class Readable:
    """The formats the server reads, by file extension (from `GET /v1/types`)."""

    types: dict[str, str]  # extension -> the media type to upload it with
    binary: frozenset[str]  # extensions of formats sent as bytes (no NUL check)
    images: frozenset[str]  # extensions of images: they would wait for OCR

    @classmethod
    def from_types(cls, body: dict[str, Any]) -> Readable:
        types: dict[str, str] = {}
        binary: set[str] = set()
        images: set[str] = set()
        for fmt in body.get("formats", []):
            for ext in fmt.get("extensions", []):
                types[ext.lower()] = fmt["mime_types"][0]
                if fmt.get("binary"):
                    binary.add(ext.lower())
                if fmt.get("kind") == "image":
                    images.add(ext.lower())
        return cls(types, frozenset(binary), frozenset(images))

    @classmethod
    def local(cls) -> Readable:
        """This client's own table: for a server that does not list its types."""
        return cls.from_types(
            {
                "formats": [
                    {
                        "extensions": list(f.extensions),
                        "mime_types": list(f.mime_types),
                        "binary": f.binary,
                        "kind": f.kind,
                    }
                    for f in FORMATS
                ]
            }
        )

    def mime_type(self, path: Path) -> tuple[str | None, str | None]:
        """(media type to upload with, None) or (None, why the file is skipped). A file of
        no listed format is uploaded as text when it is text (a script, a LICENSE)."""
        name = path.name.lower()
        packed = name.endswith(".gz")
        inner = name[:-3] if packed else name
        ext = Path(inner).suffix
        if ext in self.images:
            return None, "unsupported type (an image: it needs OCR first)"
        if ext in self.binary:
            return (GZIP_TYPE if packed else self.types[ext]), None
        if _binary(path, packed):
            known = self.types.get(ext)
            shown = f"{known}, but its bytes are binary" if known else "binary content"
            return None, f"unsupported type ({shown})"
        if packed:
            return GZIP_TYPE, None
        return self.types.get(ext, "text/plain"), None


def walk(
    options: Options, readable: Readable | None = None
) -> tuple[list[LocalFile], list[Skipped]]:
    """Every file under the roots that passes hidden/.gitignore/--include/--exclude, split
    into those the server can read and those it cannot."""
    readable = readable or Readable.local()
    files: dict[str, LocalFile] = {}
    skipped: list[Skipped] = []
    for root in options.roots:
        base = root if root.is_dir() else root.parent
        for path in _files(root):
            uri = path.relative_to(base).as_posix()
            if options.include and not _matches(uri, options.include):
                continue
            if _matches(uri, options.exclude):
                continue
            mime, reason = readable.mime_type(path)
            if mime is None:
                skipped.append(Skipped(uri, reason or "unsupported type"))
                continue
            stat = path.stat()
            files[uri] = LocalFile(path, uri, mime, stat.st_size, stat.st_mtime)
    return sorted(files.values(), key=lambda f: f.uri), skipped


def _files(root: Path) -> Iterator[Path]:
    """Files under `root` in a stable order, without hidden files and folders and without
    what the .gitignore files on the way ignore."""
    if root.is_file():
        yield root
        return
    ignores: list[tuple[Path, Any]] = []
    for directory, dirnames, filenames in os.walk(root):
        here = Path(directory)
        ignores = [(b, s) for b, s in ignores if here == b or b in here.parents]
        spec = _gitignore(here / ".gitignore")
        if spec is not None:
            ignores.append((here, spec))
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and not _ignored(ignores, here / d, True)
        )
        for name in sorted(filenames):
            path = here / name
            if not name.startswith(".") and path.is_file() and not _ignored(ignores, path, False):
                yield path


def _ignored(ignores: list[tuple[Path, Any]], path: Path, is_dir: bool) -> bool:
    for base, spec in ignores:
        rel = path.relative_to(base).as_posix() + ("/" if is_dir else "")
        if spec.match_file(rel):
            return True
    return False


def _gitignore(path: Path) -> Any:
    if not path.is_file():
        return None
    import pathspec

    return pathspec.GitIgnoreSpec.from_lines(path.read_text(errors="replace").splitlines())


def _matches(uri: str, globs: list[str]) -> bool:
    name = uri.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(uri, g) or fnmatch.fnmatch(name, g) for g in globs)


def _binary(path: Path, packed: bool = False) -> bool:
    """A file that claims to be text (or has no telling extension) but holds NUL bytes (for
    a gzip file: once decompressed, or when it does not decompress at all)."""
    try:
        if packed:
            with gzip.open(path, "rb") as f:
                return b"\0" in f.read(SNIFF_BYTES)
        with path.open("rb") as f:
            return b"\0" in f.read(SNIFF_BYTES)
    except (OSError, EOFError, zlib.error):
        return True


def file_checksum(path: Path) -> str:
    """sha256 of the bytes, as the server records it in `content_checksum`."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---- progress -------------------------------------------------------------------------------


class Progress:
    """Files, bytes and chunks done, with rich's transfer rate and time left: a bar redrawn
    in place on a terminal; elsewhere (a log, a CI job), where a redrawn line would be
    noise, the same figures as a plain `progress:` line every few seconds."""

    def __init__(self, files_total: int, bytes_total: int, out: TextIO | None = None) -> None:
        self.out = out or sys.stderr
        self.files_done = 0
        self.chunks = 0
        self._files = TextColumn("{task.fields[files]}/{task.fields[files_total]} files")
        self._bytes = DownloadColumn()
        self._chunks = TextColumn("{task.fields[chunks]} chunks indexed")
        self._rate = TransferSpeedColumn()
        self._eta = TimeRemainingColumn()
        self.bar = rich.progress.Progress(
            self._files,
            BarColumn(),
            TaskProgressColumn(),
            self._bytes,
            self._chunks,
            self._rate,
            TextColumn("ETA"),
            self._eta,
            console=Console(file=self.out),
            refresh_per_second=1 / TTY_EVERY_SECONDS,
        )
        self.task = self.bar.add_task(
            "ingest", total=bytes_total, files=0, files_total=files_total, chunks=0
        )

    def add(self, size: int, chunks: int = 0) -> None:
        self.files_done += 1
        self.chunks += chunks
        self.bar.update(self.task, advance=size, files=self.files_done, chunks=self.chunks)

    def line(self) -> str:
        """The bar's figures as text: `1/4 files, 1.0/4.1 kB, 3 chunks indexed, ...`."""
        task = self.bar.tasks[0]
        shown = [str(c.render(task)) for c in (self._files, self._bytes, self._chunks, self._rate)]
        return f"{', '.join(shown)}, ETA {self._eta.render(task)}"

    @contextlib.asynccontextmanager
    async def shown(self) -> AsyncIterator[None]:
        if self.bar.console.is_terminal:
            with self.bar:  # redrawn by rich, and left on its own line at the end
                yield
            return

        async def print_lines() -> None:
            while True:
                await asyncio.sleep(PLAIN_EVERY_SECONDS)
                self._print()

        task = asyncio.create_task(print_lines())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._print()

    def _print(self) -> None:
        self.out.write(f"progress: {self.line()}\n")
        self.out.flush()


# ---- the run --------------------------------------------------------------------------------


@dataclass
class Tally:
    uploaded: int = 0
    unchanged: int = 0
    deleted: int = 0
    skipped: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.uploaded} uploaded, {self.unchanged} unchanged, "
            f"{self.deleted} deleted, {self.skipped} skipped, {len(self.failures)} failed"
        )


class RequestFailed(Exception):
    """An API call answered with an error (the problem body's detail is the message)."""


class KbMissing(Exception):
    """The knowledge base named does not exist (and --create-kb was not given)."""


class Ingest:
    def __init__(self, options: Options) -> None:
        self.o = options
        self.files: list[LocalFile] = []
        self.tally = Tally()
        self.progress = Progress(0, 0)

    async def run(self) -> int:
        headers = {"Authorization": f"Bearer {self.o.api_key}"} if self.o.api_key else {}
        timeout = httpx.Timeout(300.0, connect=10.0)
        try:
            async with httpx.AsyncClient(
                base_url=self.o.api, headers=headers, timeout=timeout
            ) as self.http:
                await self._run()
        except KbMissing as err:
            print(f"kbmesh ingest: {err}", flush=True)
            print(self.tally.summary(), flush=True)
            return EXIT_FAILED
        except (RequestFailed, httpx.HTTPError) as err:
            self.tally.failures.append(("kbmesh", _reason(err)))
        for uri, reason in self.tally.failures:
            print(f"failed {uri}: {reason}", flush=True)
        print(self.tally.summary(), flush=True)
        return EXIT_FAILED if self.tally.failures else 0

    async def _kb(self) -> dict[str, Any]:
        """The knowledge base, checked before anything is read or uploaded."""
        response = await self.http.get(f"/v1/kbs/{self.o.kb}")
        if response.status_code != 404:
            return dict(self._answer(response))
        if not self.o.create_kb:
            raise KbMissing(
                f"knowledge base {self.o.kb!r} not found; run again with --create-kb to "
                "create it, or create it first (POST /v1/kbs)"
            )
        kb = await self._call("POST", "/v1/kbs", json={"name": self.o.kb})
        print(f"created knowledge base {self.o.kb!r} ({kb['kb_id']})", flush=True)
        return dict(kb)

    async def _readable(self) -> Readable:
        """What the server reads; this client's own table for a server that cannot say."""
        response = await self.http.get("/v1/types")
        if response.status_code == 404:
            return Readable.local()
        return Readable.from_types(self._answer(response))

    async def _run(self) -> None:
        kb = await self._kb()
        self.kb_id: str = kb["kb_id"]
        self.files, skipped = walk(self.o, await self._readable())
        self.tally.skipped = len(skipped)
        for s in skipped:
            print(f"skipped {s.uri}: {s.reason}", flush=True)
        self.progress = Progress(
            len(self.files) + len(self.o.urls), sum(f.size for f in self.files)
        )
        stored = await self._stored() if self.files or self.o.sync else {}
        limit = asyncio.Semaphore(self.o.concurrency)

        async def one(coro: Any) -> None:
            async with limit:
                await coro

        async with self.progress.shown():
            work = [one(self._file(f, stored.get(f.uri))) for f in self.files]
            work += [one(self._url(u)) for u in self.o.urls]
            await asyncio.gather(*work)
        if self.o.sync:
            present = {f.uri for f in self.files}
            gone = [d for uri, d in sorted(stored.items()) if uri not in present]
            await asyncio.gather(*(one(self._delete(d)) for d in gone))

    async def _stored(self) -> dict[str, dict[str, Any]]:
        """The source's documents by uri."""
        found: dict[str, dict[str, Any]] = {}
        skip = 0
        while True:
            page = await self._call(
                "GET",
                "/v1/documents",
                params={"source_id": self.o.source_id, "skip": skip, "limit": PAGE},
            )
            for doc in page["items"]:
                if doc.get("uri"):
                    found[doc["uri"]] = doc
            skip += len(page["items"])
            if not page["items"] or skip >= page["total"]:
                return found

    async def _file(self, f: LocalFile, stored: dict[str, Any] | None) -> None:
        try:
            digest = await asyncio.to_thread(file_checksum, f.path)
            if stored is not None and self._unchanged(stored, digest):
                self.tally.unchanged += 1
                self.progress.add(f.size)
                return
            fields: dict[str, Any] = {
                "tags": self.o.tags,
                "metadata": json.dumps(
                    {"modified_at": datetime.fromtimestamp(f.mtime, UTC).isoformat()}
                ),
                "source_id": self.o.source_id,
                "uri": f.uri,
            }
            if self.o.collection:
                fields["collection"] = self.o.collection
            if stored is not None:
                fields["document_id"] = stored["document_id"]
            # A multipart form: the file's bytes go out as they are, read from disk as they
            # are sent (no base64, never whole in memory).
            with f.path.open("rb") as handle:
                result = await self._call(
                    "POST",
                    f"/v1/kbs/{self.kb_id}/documents",
                    params={"wait": "true"},
                    data=fields,
                    files={"file": (f.path.name, handle, f.mime_type)},
                )
            await self._settled(f.uri, result, f.size)
        except (RequestFailed, httpx.HTTPError, OSError) as err:
            self.tally.failures.append((f.uri, _reason(err)))
            self.progress.add(f.size)

    def _unchanged(self, stored: dict[str, Any], digest: str) -> bool:
        return (
            stored.get("content_checksum") == digest
            and stored.get("status") != "failed"
            and self.kb_id in stored.get("kb_ids", [])
        )

    async def _url(self, url: str) -> None:
        try:
            body = {
                "url": url,
                "kb": self.kb_id,
                "tags": self.o.tags,
                "collection": self.o.collection,
                "source_id": self.o.source_id,
                "wait": True,
            }
            result = await self._call("POST", "/api/v1/tools/kb_upload", json=body)
            await self._settled(url, result, 0)
        except (RequestFailed, httpx.HTTPError) as err:
            self.tally.failures.append((url, _reason(err)))
            self.progress.add(0)

    async def _settled(self, uri: str, result: dict[str, Any], size: int) -> None:
        """Count an upload once its document is indexed or failed (polling when the upload's
        own wait ended first)."""
        if result["status"] == "processing":
            result = await self._polled(result["document_id"])
        if result["status"] == "failed":
            self.tally.failures.append((uri, result.get("error") or "failed"))
        elif result["status"] == "processing":
            self.tally.failures.append((uri, "not indexed in time"))
        else:
            self.tally.uploaded += 1
        self.progress.add(size, result.get("chunk_count") or 0)

    async def _polled(self, document_id: str) -> dict[str, Any]:
        """The document once it is no longer processing, looked at every POLL_SECONDS; as
        it is after SETTLE_SECONDS."""

        async def look() -> dict[str, Any]:
            response = await self.http.get(f"/v1/documents/{document_id}")
            if response.status_code == 404:
                # Accepted, but ingest has not taken the upload yet (a long queue).
                return {"status": "processing", "document_id": document_id}
            doc = self._answer(response)
            result = {**doc, "chunk_count": None}
            if doc["status"] == "complete":
                result["chunk_count"] = await self._chunk_count(doc)
            return result

        retrying = AsyncRetrying(
            retry=retry_if_result(lambda result: result["status"] == "processing"),
            wait=wait_fixed(POLL_SECONDS),
            stop=stop_after_delay(SETTLE_SECONDS),
            retry_error_callback=_last_result,
        )
        result: dict[str, Any] = await retrying(look)
        return result

    async def _chunk_count(self, doc: dict[str, Any]) -> int:
        page = await self._call(
            "GET",
            f"/v1/kbs/{self.kb_id}/documents",
            params={"name_search": doc["name"], "limit": PAGE},
        )
        for item in page["items"]:
            if item["document_id"] == doc["document_id"]:
                return int(item["chunk_count"])
        return 0

    async def _delete(self, doc: dict[str, Any]) -> None:
        try:
            await self._call(
                "DELETE", f"/v1/documents/{doc['document_id']}", params={"wait": "true"}
            )
            self.tally.deleted += 1
            print(f"deleted {doc['uri']}", flush=True)
        except (RequestFailed, httpx.HTTPError) as err:
            self.tally.failures.append((doc["uri"], f"delete failed: {_reason(err)}"))

    async def _call(self, method: str, url: str, **kwargs: Any) -> Any:
        return self._answer(await self.http.request(method, url, **kwargs))

    def _answer(self, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail") or response.text
            except ValueError:
                detail = response.text
            raise RequestFailed(f"HTTP {response.status_code}: {detail}")
        return response.json()


def _last_result(state: RetryCallState) -> Any:
    """What the last poll found, once polling stops."""
    return state.outcome.result() if state.outcome else None


def _reason(err: Exception) -> str:
    if isinstance(err, httpx.HTTPError) and not str(err):
        return type(err).__name__
    return str(err) or type(err).__name__
