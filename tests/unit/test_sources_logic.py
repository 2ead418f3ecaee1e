"""The sources service's pure rules: which sources are due, when a lease may be taken, how a
git diff becomes document changes, how remotes are read, and how cursors are kept."""

from __future__ import annotations

import subprocess
from datetime import timedelta
from pathlib import Path

import pytest

from services.common.domain.models import utcnow
from services.common.domain.sources import Source, SourceLease, SourceState
from services.sources.fetch import SourceError
from services.sources.git import (
    Globs,
    changes_of,
    parse_raw_diff,
    parse_remote,
    parse_tree,
    redact,
)
from services.sources.service import decode_cursor, due, encode_cursor, event_id, lease_free


def source(**fields: object) -> Source:
    body: dict[str, object] = {
        "kind": "git",
        "kb": "docs",
        "url": "https://example.com/r.git",
        "org_id": "acme",
        "source_id": "s1",
        "kb_id": "k1",
    }
    body.update(fields)
    return Source.model_validate(body)


def state(**fields: object) -> SourceState:
    return SourceState.model_validate({"org_id": "acme", "source_id": "s1", **fields})


def test_a_source_that_never_ran_is_due_at_once():
    assert due(source(), None, utcnow()) == "schedule"


def test_a_source_is_due_when_its_next_run_has_come_and_not_before():
    now = utcnow()
    assert due(source(), state(next_run_at=now - timedelta(seconds=1)), now) == "schedule"
    assert due(source(), state(next_run_at=now + timedelta(minutes=5)), now) is None


def test_a_sync_asked_for_runs_now_even_when_disabled_and_names_its_trigger():
    now = utcnow()
    later = now + timedelta(hours=1)
    assert due(source(), state(next_run_at=later, requested="hook"), now) == "hook"
    assert due(source(enabled=False), state(requested="manual"), now) == "manual"


def test_a_disabled_source_does_not_run_on_its_schedule():
    assert due(source(enabled=False), None, utcnow()) is None


def test_a_run_that_never_ended_is_due_again_even_on_a_disabled_source():
    """Its replica died holding the lease: the next run (once the lease expires) finishes
    the work, whatever the schedule says."""
    now = utcnow()
    left = SourceLease(holder="dead", run_id="r", expires_at=now + timedelta(seconds=5))
    later = state(next_run_at=now + timedelta(hours=1))
    assert due(source(enabled=False), later, now, left) == "schedule"
    assert due(source(), later, now, left) == "schedule"


def test_a_lease_is_free_when_absent_or_expired_only():
    now = utcnow()
    held = SourceLease(holder="a", run_id="r", expires_at=now + timedelta(seconds=5))
    expired = SourceLease(holder="a", run_id="r", expires_at=now - timedelta(seconds=1))
    assert lease_free(None, now)
    assert not lease_free(held, now)
    assert lease_free(expired, now)


def test_event_ids_are_the_same_for_a_run_done_again_and_differ_otherwise():
    assert event_id("s1", "a.md", "c1", "c0") == event_id("s1", "a.md", "c1", "c0")
    assert event_id("s1", "a.md", "c1", "c0") != event_id("s1", "a.md", "c1", "c2")
    assert event_id("s1", "a.md", "c1", "c0") != event_id("s1", "b.md", "c1", "c0")


def test_cursors_keep_text_as_it_is_and_any_bytes_exactly():
    assert encode_cursor(b"abc123 digest") == "abc123 digest"
    for raw in (b"\xff\x00binary", b"base64:looks-marked", b"", None):
        assert decode_cursor(encode_cursor(raw)) == raw


# ---- git ----------------------------------------------------------------------------------


def git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "r"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.email", "t@example.com")
    git(path, "config", "user.name", "t")
    return path


def commit(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").decode().strip()


def test_a_real_diff_becomes_puts_and_gones_rename_as_both(repo: Path):
    """Added, modified, renamed, deleted, a file turned symlink, a submodule-free tree: read
    from `git diff --raw -z -M` of a real repository."""
    (repo / "docs").mkdir()
    (repo / "docs" / "keep.md").write_text("# keep\n" + "stable words here\n" * 20)
    (repo / "docs" / "edit.md").write_text("# edit\nfirst version\n")
    (repo / "docs" / "old-name.md").write_text("# moving\n" + "moving content line\n" * 20)
    (repo / "docs" / "drop.md").write_text("# drop\nbye\n")
    (repo / "docs" / "link-me.md").write_text("# becomes a link\n")
    (repo / "image.bin").write_bytes(b"\x00\x01")
    first = commit(repo, "one")
    (repo / "docs" / "edit.md").write_text("# edit\nsecond version\n")
    (repo / "docs" / "old-name.md").rename(repo / "docs" / "new-name.md")
    (repo / "docs" / "drop.md").unlink()
    (repo / "docs" / "link-me.md").unlink()
    (repo / "docs" / "link-me.md").symlink_to("keep.md")
    (repo / "docs" / "added.md").write_text("# added\n")
    second = commit(repo, "two")

    raw = git(repo, "diff", "--raw", "-z", "-M", "--no-abbrev", first, second)
    diffs = parse_raw_diff(raw)
    statuses = {(d.status, (d.old or d.new).path) for d in diffs if d.old or d.new}  # type: ignore[union-attr]
    assert ("R", "docs/old-name.md") in statuses
    changes = sorted((kind, e.path) for kind, e in changes_of(diffs, Globs(["docs/**"], [])))
    assert changes == [
        ("gone", "docs/drop.md"),
        ("gone", "docs/link-me.md"),
        ("gone", "docs/old-name.md"),
        ("put", "docs/added.md"),
        ("put", "docs/edit.md"),
        ("put", "docs/new-name.md"),
    ]


def test_globs_filter_both_sides_of_a_rename(repo: Path):
    """A file renamed out of the included paths is gone; one renamed into them is new."""
    (repo / "docs").mkdir()
    (repo / "attic").mkdir()
    (repo / "docs" / "leaving.md").write_text("leaving content line\n" * 20)
    (repo / "attic" / "arriving.md").write_text("arriving content line\n" * 20)
    first = commit(repo, "one")
    (repo / "docs" / "leaving.md").rename(repo / "attic" / "leaving.md")
    (repo / "attic" / "arriving.md").rename(repo / "docs" / "arriving.md")
    second = commit(repo, "two")
    diffs = parse_raw_diff(git(repo, "diff", "--raw", "-z", "-M", "--no-abbrev", first, second))
    changes = sorted((k, e.path) for k, e in changes_of(diffs, Globs(["docs/**"], ["*.tmp"])))
    assert changes == [("gone", "docs/leaving.md"), ("put", "docs/arriving.md")]


def test_the_tree_lists_modes_so_symlinks_are_not_documents(repo: Path):
    (repo / "a.md").write_text("a\n")
    (repo / "b.md").symlink_to("/etc/passwd")
    head = commit(repo, "one")
    entries = {e.path: e for e in parse_tree(git(repo, "ls-tree", "-r", "-z", head))}
    assert entries["a.md"].regular and not entries["b.md"].regular


def test_globs_are_gitignore_patterns():
    globs = Globs(["docs/**", "*.md"], ["docs/private/**"])
    assert globs.matches("docs/a.txt") and globs.matches("README.md")
    assert not globs.matches("src/main.py") and not globs.matches("docs/private/x.md")
    assert Globs([], []).matches("anything/at/all")


def test_remotes_are_read_with_their_ports_and_local_paths_must_be_absolute():
    assert parse_remote("git@github.com:org/repo.git").scheme == "ssh"
    assert parse_remote("git@github.com:org/repo.git").port == 22
    assert parse_remote("git://127.0.0.1:9500/r").port == 9500
    assert parse_remote("https://h/r.git").port == 443
    assert parse_remote("/srv/repos/r").scheme == "file"
    for bad in ("ftp://h/r", "file://relative/r", "r.git"):
        with pytest.raises(SourceError):
            parse_remote(bad)


def test_credentials_in_urls_are_redacted_from_messages():
    text = "fatal: unable to access 'https://user:tok3n@host/r.git/': 403"
    assert "tok3n" not in redact(text) and "https://host/r.git" in redact(text)
