"""Git repositories as sources, read with the git CLI.

Each source keeps a bare repository of its own under the cache directory (the data
directory's `sources/git/<org>.<source>`), fetched into on every run, so a run transfers only
the commits pushed since the last one. The cache is an optimisation, never the truth: a lost
or damaged one is cloned again, and the state a run continues from is the commit it synced
(with a digest of the source's include/exclude globs), kept in the source's state record.

- The first run, a run whose last commit is no longer in the repository (a force push), and a
  run after the globs changed list the whole tree (`Done.complete`: the service then deletes
  the source's documents the listing no longer names). Other runs read
  `git diff --raw -M <last> <new>`: added, modified and copied files are `Put`, a rename is
  `Gone` of the old path and `Put` of the new, a deletion is `Gone`.
- Only regular files are documents: a symlink is never followed (it is not a document, and
  may point out of the repository), a submodule is not fetched (its commit is not content),
  and a Git LFS pointer is reported `Failed` (LFS objects are not fetched).
- Limits, per run: a file over the upload limit is `Failed`; a repository whose matching
  files exceed `MAX_FILES` fails the run before anything is sent (narrow `include`); a fetch
  whose pack grows past `MAX_REPOSITORY_BYTES`, or that takes longer than `FETCH_SECONDS`,
  is stopped and fails the run.
- Every remote goes through the egress rule: the host is resolved and vetted, and git is
  made to connect to that vetted address (https: `http.curloptResolve`; git:// and ssh: the
  address in place of the name); redirects are not followed; only the remote's own protocol
  is enabled (`protocol.file` only for local paths, which only operators may set).
- Credentials never reach argv, URLs or logs: an https token is answered by a `GIT_ASKPASS`
  script from the process's environment; an ssh key is a 0600 file in a private temporary
  directory removed after the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import httpx
import pathspec

from services.common.domain.errors import KbmeshError
from services.common.domain.sources import Source, SourceSecrets
from services.common.outbound.egress import EgressPolicy
from services.sources.fetch import Change, Done, Failed, Gone, Put, SourceError

log = logging.getLogger("kbmesh.sources.git")

# Files a run may send: a repository (or a diff) with more matching files fails the run, so
# that a partial run never advances the cursor past files it did not send.
MAX_FILES = 20_000
# The bare repository's size on disk after a fetch (packs and loose objects).
MAX_REPOSITORY_BYTES = 2 * 1024 * 1024 * 1024
# One fetch of the remote, and each local git command.
FETCH_SECONDS = 600.0
LOCAL_SECONDS = 120.0
# How often a running fetch's size is checked against MAX_REPOSITORY_BYTES.
SIZE_CHECK_SECONDS = 0.5
# Git LFS pointer files are small text files that start with this line.
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"
LFS_POINTER_MAX = 1024
# The user name sent with an https token (GitHub and GitLab accept any name with a token;
# a name in the URL wins).
TOKEN_USER = "x-access-token"
REGULAR_MODES = ("100644", "100755")
# Where the fetched commit is kept in each source's bare repository.
HEAD_REF = "refs/kbmesh/head"
_SCP_LIKE = re.compile(r"^(?:(?P<user>[^@/]+)@)?(?P<host>[^:/]+):(?P<path>(?!//).+)$")


# ---- remotes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Remote:
    """A source's URL as git will be given it, and what the egress rule must vet."""

    url: str  # what git fetches from (the vetted address in place of the host name)
    scheme: str  # https, http, git, ssh or file
    host: str | None = None
    port: int | None = None
    # https: `host:port:address` for http.curloptResolve (TLS still checks the name).
    resolve: str | None = None
    # ssh: the host name its key is checked under, since the URL names the address.
    host_key_alias: str | None = None


def parse_remote(url: str) -> Remote:
    """The remote `url` names: an https/http/git/ssh URL, an scp-like `user@host:path`, or a
    local path (absolute, or file://). InvalidInput otherwise."""
    if url.startswith("file://") or url.startswith("/"):
        path = url.removeprefix("file://")
        if not path.startswith("/"):
            raise SourceError(f"local repository path {url!r} must be absolute")
        return Remote(path, "file")
    scp = _SCP_LIKE.match(url)
    if scp and "://" not in url:
        user = f"{scp['user']}@" if scp["user"] else ""
        url = f"ssh://{user}{scp['host']}/{scp['path']}"
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as err:
        raise SourceError(f"invalid repository URL: {err}") from err
    if parsed.scheme not in ("https", "http", "git", "ssh") or not parsed.host:
        raise SourceError(
            "a git source's url is an https://, ssh://, git:// URL, user@host:path, or an "
            "absolute local path"
        )
    default = {"https": 443, "http": 80, "git": 9418, "ssh": 22}[parsed.scheme]
    return Remote(url, parsed.scheme, parsed.host, parsed.port or default)


async def vet_remote(remote: Remote, egress: EgressPolicy) -> Remote:
    """`remote` once the egress rule allows its host, pinned to the vetted address."""
    if remote.scheme == "file" or remote.host is None or remote.port is None:
        return remote
    try:
        addresses = await egress.vet(
            httpx.URL(remote.url), field="url", what="fetch the repository at"
        )
    except KbmeshError as err:
        raise SourceError(str(err)) from err
    address = str(addresses[0])
    literal = f"[{address}]" if ":" in address else address
    if remote.scheme in ("https", "http"):
        return Remote(
            remote.url,
            remote.scheme,
            remote.host,
            remote.port,
            resolve=f"{remote.host}:{remote.port}:{literal}",
        )
    pinned = httpx.URL(remote.url).copy_with(host=address)
    alias = remote.host if remote.scheme == "ssh" else None
    return Remote(str(pinned), remote.scheme, remote.host, remote.port, host_key_alias=alias)


def redact(text: str) -> str:
    """`text` (git's output) with any user-info of a URL removed, for errors and logs."""
    return re.sub(r"(\w+://)[^/@\s]+@", r"\1", text)


# ---- the tree and the diff ----------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """A path in a commit's tree, or one side of a diff."""

    path: str
    mode: str
    blob: str

    @property
    def regular(self) -> bool:
        return self.mode in REGULAR_MODES


@dataclass(frozen=True)
class Diff:
    """One line of `git diff --raw -z`: `status` A, M, T, D, R or C; `old` / `new` the sides
    that exist (a deletion has no new side, an addition no old side)."""

    status: str
    old: Entry | None
    new: Entry | None


NULL_BLOB = "0" * 40


def parse_raw_diff(output: bytes) -> list[Diff]:
    """`git diff --raw -z -M` output as `Diff`s. Each record is `:<old mode> <new mode> <old
    blob> <new blob> <status>` NUL path NUL, and for renames and copies a second path."""
    fields = output.split(b"\0")
    diffs: list[Diff] = []
    i = 0
    while i < len(fields) and fields[i]:
        meta = fields[i].decode()
        if not meta.startswith(":"):
            raise ValueError(f"unexpected git diff output: {meta[:80]!r}")
        old_mode, new_mode, old_blob, new_blob, status = meta[1:].split(" ")
        kind = status[0]
        if kind in "RC":
            old_path, new_path = fields[i + 1].decode(), fields[i + 2].decode()
            i += 3
        else:
            old_path = new_path = fields[i + 1].decode()
            i += 2
        old = None if kind == "A" else Entry(old_path, old_mode, old_blob)
        new = None if kind == "D" else Entry(new_path, new_mode, new_blob)
        diffs.append(Diff(kind, old, new))
    return diffs


def parse_tree(output: bytes) -> list[Entry]:
    """`git ls-tree -r -z <commit>` output: `<mode> <type> <blob>` TAB path, per entry."""
    entries = []
    for record in output.split(b"\0"):
        if not record:
            continue
        meta, _, path = record.partition(b"\t")
        mode, _kind, blob = meta.decode().split(" ")
        entries.append(Entry(path.decode(), mode, blob))
    return entries


class Globs:
    """A source's include and exclude globs, as .gitignore patterns (`docs/**`, `*.md`)."""

    def __init__(self, include: list[str], exclude: list[str]) -> None:
        self.include = pathspec.PathSpec.from_lines("gitwildmatch", include) if include else None
        self.exclude = pathspec.PathSpec.from_lines("gitwildmatch", exclude)
        self.digest = hashlib.sha256(json.dumps([include, exclude]).encode()).hexdigest()[:16]

    def matches(self, path: str) -> bool:
        if self.include is not None and not self.include.match_file(path):
            return False
        return not self.exclude.match_file(path)


def changes_of(diffs: list[Diff], globs: Globs) -> Iterator[tuple[str, Entry]]:
    """What a diff means for the documents: ("put", entry) for a path whose new content is
    a document, ("gone", entry) for a document path that no longer holds one. A rename is
    the old path gone and the new one put; a file that became a symlink or submodule is
    gone."""
    for diff in diffs:
        old, new = diff.old, diff.new
        put = new if new is not None and new.regular and globs.matches(new.path) else None
        was_doc = old is not None and old.regular and globs.matches(old.path)
        # A copy leaves its origin in place; a change in place is a put alone.
        moved = put is None or (old is not None and put.path != old.path)
        if old is not None and was_doc and diff.status != "C" and moved:
            yield "gone", old
        if put is not None:
            yield "put", put


# ---- running git --------------------------------------------------------------------------


class GitFailed(SourceError):
    """A git command failed; the message is git's own (credentials redacted)."""


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


async def run_git(
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = LOCAL_SECONDS,
    what: str = "git",
) -> bytes:
    """Run `git args...`; its stdout, or GitFailed with its stderr. The process group is
    killed on timeout or cancellation (a fetch starts helpers: ssh, git-remote-https)."""
    proc = await asyncio.create_subprocess_exec(
        "git",
        *args,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError as exc:
        _kill(proc)
        await proc.wait()
        raise GitFailed(f"{what} took longer than {timeout:g} s") from exc
    except BaseException:
        _kill(proc)
        raise
    if proc.returncode != 0:
        message = redact(err.decode(errors="replace").strip())[-800:]
        raise GitFailed(f"{what} failed: {message or f'exit status {proc.returncode}'}")
    return out


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class BlobReader:
    """`git cat-file --batch`: blobs read one after another through one process."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> BlobReader:
        self.proc = await asyncio.create_subprocess_exec(
            "git",
            "cat-file",
            "--batch",
            cwd=self.repo,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            limit=1024 * 1024,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None:
            _kill(self.proc)
            await self.proc.wait()

    async def read(self, blob: str, max_bytes: int) -> bytes | int:
        """The blob's bytes, or its size when it is larger than `max_bytes` (its bytes are
        then skipped, never held)."""
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(f"{blob}\n".encode())
        await self.proc.stdin.drain()
        header = (await self.proc.stdout.readline()).decode().split()
        if len(header) != 3:
            raise GitFailed(f"cannot read blob {blob}: {' '.join(header)}")
        size = int(header[2])
        if size > max_bytes:
            left = size + 1
            while left:
                left -= len(await self.proc.stdout.read(min(left, 1 << 20)))
            return size
        data = await self.proc.stdout.readexactly(size + 1)
        return data[:-1]


# ---- the fetcher --------------------------------------------------------------------------


@dataclass(frozen=True)
class GitState:
    """Where a git source's sync stands: the commit synced and its globs' digest."""

    commit: str
    globs: str

    def encode(self) -> bytes:
        return f"{self.commit} {self.globs}".encode()

    @classmethod
    def decode(cls, state: bytes | None) -> GitState | None:
        if not state:
            return None
        commit, _, globs = state.decode().partition(" ")
        return cls(commit, globs)


class GitFetcher:
    """The `Fetcher` of git sources (services/sources/fetch.py)."""

    def __init__(
        self,
        egress: EgressPolicy,
        cache_dir: Path,
        *,
        max_file_bytes: int,
        max_files: int = MAX_FILES,
        max_repository_bytes: int = MAX_REPOSITORY_BYTES,
        fetch_seconds: float = FETCH_SECONDS,
    ) -> None:
        self.egress = egress
        self.cache_dir = cache_dir
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self.max_repository_bytes = max_repository_bytes
        self.fetch_seconds = fetch_seconds

    def repository(self, source: Source) -> Path:
        return self.cache_dir / f"{source.org_id}.{source.source_id}.git"

    async def fetch(
        self, source: Source, secrets: SourceSecrets | None, state: bytes | None
    ) -> AsyncIterator[Change | Done]:
        remote = await vet_remote(parse_remote(source.url), self.egress)
        repo = self.repository(source)
        with tempfile.TemporaryDirectory(prefix="kbmesh-git-") as private:
            env = _environment(Path(private), remote, secrets)
            commit = await self._fetch(repo, remote, source.branch, env)
        globs = Globs(source.include, source.exclude)
        last = GitState.decode(state)
        diffs: list[Diff] | None = None
        if last is not None and last.globs == globs.digest:
            if last.commit == commit:
                diffs = []
            elif await self._has_commit(repo, last.commit):
                raw = await run_git(
                    "diff",
                    "--raw",
                    "-z",
                    "-M",
                    "--no-abbrev",
                    last.commit,
                    commit,
                    cwd=repo,
                    what="git diff",
                )
                diffs = parse_raw_diff(raw)
        if diffs is None:
            tree = parse_tree(await run_git("ls-tree", "-r", "-z", commit, cwd=repo))
            work = [("put", e) for e in tree if e.regular and globs.matches(e.path)]
        else:
            work = list(changes_of(diffs, globs))
        if len(work) > self.max_files:
            raise SourceError(
                f"{len(work)} files match in this run, more than the {self.max_files} a run "
                "may send; narrow the source's include globs"
            )
        read = 0
        async with BlobReader(repo) as blobs:
            for action, entry in work:
                if action == "gone":
                    yield Gone(entry.path)
                    continue
                data = await blobs.read(entry.blob, self.max_file_bytes)
                if isinstance(data, int):
                    yield Failed(
                        entry.path,
                        f"{data} bytes, larger than the {self.max_file_bytes}-byte upload limit",
                    )
                    continue
                read += len(data)
                if data.startswith(LFS_POINTER) and len(data) <= LFS_POINTER_MAX:
                    yield Failed(entry.path, "a Git LFS pointer: LFS content is not fetched")
                    continue
                yield Put(
                    uri=entry.path,
                    name=PurePosixPath(entry.path).name,
                    content=data,
                    # The document's source revision: the commit it was read at.
                    revision=commit,
                )
        yield Done(
            state=GitState(commit, globs.digest).encode(),
            revision=commit,
            requests=1,
            bytes_read=read,
            complete=diffs is None,
        )

    async def _has_commit(self, repo: Path, commit: str) -> bool:
        try:
            await run_git("cat-file", "-e", f"{commit}^{{commit}}", cwd=repo)
        except GitFailed:
            return False
        return True

    async def _fetch(
        self, repo: Path, remote: Remote, branch: str | None, env: dict[str, str]
    ) -> str:
        """Fetch `branch` (a branch or tag; default the remote's HEAD) into the source's bare
        repository (created, or created again when damaged); the commit fetched."""
        if not (repo / "HEAD").exists():
            shutil.rmtree(repo, ignore_errors=True)
            repo.parent.mkdir(parents=True, exist_ok=True)
            await run_git("init", "--bare", "--quiet", str(repo), env=env)
        ref = branch or "HEAD"
        if ref.startswith("-") or ".." in ref or any(c in ref for c in " ~^:?*[\\"):
            raise SourceError(f"invalid branch or tag {ref!r}")
        args = [*_protocol_config(remote), "fetch", "--quiet", "--no-tags", "--force"]
        args += ["--no-recurse-submodules", "--", remote.url, f"+{ref}:{HEAD_REF}"]
        fetch = asyncio.ensure_future(
            run_git(*args, cwd=repo, env=env, timeout=self.fetch_seconds, what="git fetch")
        )
        try:
            while not fetch.done():
                await asyncio.wait([fetch], timeout=SIZE_CHECK_SECONDS)
                size = await asyncio.to_thread(tree_bytes, repo / "objects")
                if size > self.max_repository_bytes:
                    fetch.cancel()
                    with contextlib.suppress(asyncio.CancelledError, SourceError):
                        await fetch
                    shutil.rmtree(repo, ignore_errors=True)
                    raise SourceError(
                        f"the repository is larger than the {self.max_repository_bytes} bytes "
                        "a source may hold; the fetch was stopped"
                    )
            await fetch
        except SourceError as err:
            if isinstance(err, GitFailed) and "corrupt" in str(err).lower():
                shutil.rmtree(repo, ignore_errors=True)  # cloned again next run
            raise
        finally:
            if not fetch.done():
                fetch.cancel()
                with contextlib.suppress(BaseException):
                    await fetch
        out = await run_git("rev-parse", "--verify", f"{HEAD_REF}^{{commit}}", cwd=repo)
        return out.decode().strip()


def _protocol_config(remote: Remote) -> list[str]:
    """Only the remote's own protocol, no redirects, no credential helpers, and the vetted
    address for https."""
    config = {
        "protocol.allow": "never",
        f"protocol.{remote.scheme}.allow": "always",
        "http.followRedirects": "false",
        "credential.helper": "",
        "transfer.fsckObjects": "false",
        "core.hooksPath": "/dev/null",
    }
    if remote.resolve:
        config["http.curloptResolve"] = remote.resolve
    args: list[str] = []
    for key, value in config.items():
        args += ["-c", f"{key}={value}"]
    return args


ASKPASS = """#!/bin/sh
case "$1" in
  Username*) printf '%s\\n' "$KBMESH_GIT_USERNAME" ;;
  *) printf '%s\\n' "$KBMESH_GIT_PASSWORD" ;;
esac
"""


def _environment(private: Path, remote: Remote, secrets: SourceSecrets | None) -> dict[str, str]:
    """git's environment: no terminal prompts, no user or system configuration, and the
    source's credentials for this remote (in files under `private`, and variables only git
    and its helpers see)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(private),
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_PROTOCOL_FROM_USER": "0",
        "LC_ALL": "C",
    }
    ssh = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new"]
    ssh += ["-o", f"UserKnownHostsFile={private / 'known_hosts'}"]
    if remote.host_key_alias:
        ssh += ["-o", f"HostKeyAlias={remote.host_key_alias}"]
    if secrets is not None and secrets.token and remote.scheme in ("https", "http"):
        askpass = private / "askpass"
        askpass.write_text(ASKPASS)
        askpass.chmod(0o700)
        env |= {
            "GIT_ASKPASS": str(askpass),
            "KBMESH_GIT_USERNAME": TOKEN_USER,
            "KBMESH_GIT_PASSWORD": secrets.token,
        }
    if secrets is not None and secrets.ssh_key and remote.scheme == "ssh":
        key = private / "key"
        key.touch(mode=0o600)
        key.write_text(secrets.ssh_key.strip() + "\n")
        ssh += ["-i", str(key), "-o", "IdentitiesOnly=yes"]
    env["GIT_SSH_COMMAND"] = " ".join(ssh)
    return env
