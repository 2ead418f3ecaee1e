"""The git fetcher on its own, against real repositories (a local path, as operators may
set, and `git daemon` on loopback): the rules for what is a document, the limits, the
egress rule, and the state a run continues from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.common.domain.sources import Source, SourceSecrets
from services.common.outbound.egress import EgressPolicy
from services.sources.fetch import Done, Failed, Gone, Put, SourceError
from services.sources.git import LFS_POINTER, GitFetcher
from tests.support.gitserver import git, git_daemon, git_http

LFS = LFS_POINTER + b"\noid sha256:" + b"4d7a2146" * 8 + b"\nsize 12345\n"


def source(url: str, **fields: Any) -> Source:
    return Source(kind="git", kb="kb", url=url, org_id="acme", source_id="s1", kb_id="k1", **fields)


async def changes(fetcher: GitFetcher, src: Source, state: bytes | None) -> tuple[list, Done]:  # type: ignore[type-arg]
    found = [c async for c in fetcher.fetch(src, None, state)]
    done = found.pop()
    assert isinstance(done, Done)
    return found, done


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.email", "t@example.com")
    git(path, "config", "user.name", "t")
    return path


def commit(path: Path) -> str:
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "c")
    return git(path, "rev-parse", "HEAD").strip()


async def test_only_regular_files_within_limits_are_documents(repo: Path, tmp_path: Path):
    """From a local path: a file over the size limit and an LFS pointer are Failed with the
    reason; a symlink (even to a file outside) and a submodule are no documents; the first
    run is complete (it names every document) and continues from the commit."""
    (repo / "ok.md").write_text("# fine\n")
    (repo / "big.md").write_text("x" * 500)
    (repo / "model.bin").write_bytes(LFS)
    (repo / "escape.md").symlink_to("/etc/passwd")
    head = commit(repo)
    # A submodule: a commit in the tree, not content.
    git(repo, "update-index", "--add", "--cacheinfo", f"160000,{head},vendored")
    git(repo, "commit", "-q", "-m", "a submodule entry")
    head = git(repo, "rev-parse", "HEAD").strip()
    fetcher = GitFetcher(EgressPolicy(), tmp_path / "cache", max_file_bytes=200)
    found, done = await changes(fetcher, source(str(repo)), None)
    puts = {c.uri: c for c in found if isinstance(c, Put)}
    failed = {c.uri: c.error for c in found if isinstance(c, Failed)}
    assert set(puts) == {"ok.md"} and puts["ok.md"].content == b"# fine\n"
    assert puts["ok.md"].revision == head
    assert set(failed) == {"big.md", "model.bin"}
    assert "limit" in failed["big.md"] and "LFS" in failed["model.bin"]
    assert done.complete and done.revision == head and done.state is not None
    again, nothing = await changes(fetcher, source(str(repo)), done.state)
    assert again == [] and not nothing.complete


async def test_a_lost_cursor_or_changed_globs_list_the_whole_tree(repo: Path, tmp_path: Path):
    """A cursor the repository no longer has (a force push, a lost cache) and a cursor
    written under other globs both end in a complete listing, never a wrong diff."""
    (repo / "a.md").write_text("a\n")
    (repo / "b.txt").write_text("b\n")
    commit(repo)
    fetcher = GitFetcher(EgressPolicy(), tmp_path / "cache", max_file_bytes=1000)
    _, done = await changes(fetcher, source(str(repo)), None)
    assert done.state is not None
    lost = b"0123456789abcdef0123456789abcdef01234567 " + done.state.split(b" ")[1]
    found, again = await changes(fetcher, source(str(repo)), lost)
    assert again.complete and {c.uri for c in found} == {"a.md", "b.txt"}
    found, narrowed = await changes(fetcher, source(str(repo), include=["*.md"]), done.state)
    assert narrowed.complete and {c.uri for c in found} == {"a.md"}


async def test_too_many_files_fail_the_run_before_anything_is_sent(repo: Path, tmp_path: Path):
    for i in range(5):
        (repo / f"{i}.md").write_text(f"{i}\n")
    commit(repo)
    fetcher = GitFetcher(EgressPolicy(), tmp_path / "cache", max_file_bytes=1000, max_files=4)
    with pytest.raises(SourceError, match="5 files match"):
        await changes(fetcher, source(str(repo)), None)


async def test_a_loopback_remote_is_refused_unless_the_egress_rule_allows_it(tmp_path: Path):
    """git:// on loopback: refused by the default rule before git runs; fetched once
    private addresses are allowed; a missing branch fails the run with git's reason."""
    with git_daemon(tmp_path / "served") as daemon:
        served = daemon.repo("r")
        served.write("doc.md", "# served\n")
        head = served.commit("one")
        strict = GitFetcher(EgressPolicy(), tmp_path / "c1", max_file_bytes=1000)
        with pytest.raises(SourceError, match="non-public address"):
            await changes(strict, source(served.url), None)
        assert not (tmp_path / "c1").exists()
        allowed = GitFetcher(EgressPolicy(allow_private=True), tmp_path / "c2", max_file_bytes=1000)
        found, done = await changes(allowed, source(served.url), None)
        assert [c.uri for c in found] == ["doc.md"] and done.revision == head
        with pytest.raises(SourceError, match="no-such"):
            await changes(allowed, source(served.url, branch="no-such"), None)


async def test_deletions_and_renames_since_the_cursor(repo: Path, tmp_path: Path):
    (repo / "keep.md").write_text("keep this text around for a while\n" * 5)
    (repo / "gone.md").write_text("gone\n")
    commit(repo)
    fetcher = GitFetcher(EgressPolicy(), tmp_path / "cache", max_file_bytes=10_000)
    _, first = await changes(fetcher, source(str(repo)), None)
    (repo / "keep.md").rename(repo / "kept.md")
    (repo / "gone.md").unlink()
    commit(repo)
    found, _ = await changes(fetcher, source(str(repo)), first.state)
    assert sorted((type(c).__name__, c.uri) for c in found) == [
        ("Gone", "gone.md"),
        ("Gone", "keep.md"),
        ("Put", "kept.md"),
    ]
    assert all(isinstance(c, Gone | Put) for c in found)


async def test_an_https_token_is_sent_by_askpass_and_never_shows(tmp_path: Path):
    """Smart HTTP behind a token: without the token the run fails (git's refusal, which
    names no secret); with it, git answers the server's challenge through the askpass
    helper, and the fetch succeeds. The token is in no error and in no URL."""
    root = tmp_path / "root"
    root.mkdir()
    served = root / "r.git"
    work = tmp_path / "work"
    work.mkdir()
    git(work, "init", "-q", "-b", "main")
    git(work, "config", "user.email", "t@example.com")
    git(work, "config", "user.name", "t")
    (work / "secret-doc.md").write_text("# behind a token\n")
    commit(work)
    git(tmp_path, "clone", "-q", "--bare", str(work), str(served))
    token = "ghp_" + "s3cr3t" * 6
    fetcher = GitFetcher(EgressPolicy(allow_private=True), tmp_path / "cache", max_file_bytes=1000)
    with git_http(root, token) as server:
        src = source(f"{server.url}/r.git")
        with pytest.raises(SourceError) as refused:
            await changes(fetcher, src, None)
        assert token not in str(refused.value)
        wrong = SourceSecrets(token="ghp_wrong", webhook_secret="w")
        with pytest.raises(SourceError) as refused_wrong:
            [c async for c in fetcher.fetch(src, wrong, None)]
        assert "ghp_wrong" not in str(refused_wrong.value)
        right = SourceSecrets(token=token, webhook_secret="w")
        found = [c async for c in fetcher.fetch(src, right, None)]
        assert [c.uri for c in found if isinstance(c, Put)] == ["secret-doc.md"]
        assert any(a.startswith("Basic ") for a in server.seen_authorization)
