"""A git server on loopback for git sources: `git daemon` serving the repositories under one
directory, and a working repository to commit to."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.common.bus.nats_server import free_port, wait_for_port


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)
    return done.stdout.decode()


@dataclass
class Repo:
    """A repository the daemon serves, committed to in place."""

    path: Path
    url: str

    def write(self, relative: str, text: str) -> None:
        target = self.path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def commit(self, message: str) -> str:
        git(self.path, "add", "-A")
        git(self.path, "commit", "-q", "-m", message)
        return git(self.path, "rev-parse", "HEAD").strip()


@dataclass
class GitDaemon:
    base: Path
    port: int

    def repo(self, name: str) -> Repo:
        path = self.base / name
        path.mkdir(parents=True)
        git(path, "init", "-q", "-b", "main")
        git(path, "config", "user.email", "tests@example.com")
        git(path, "config", "user.name", "tests")
        return Repo(path, f"git://127.0.0.1:{self.port}/{name}")


@contextlib.contextmanager
def git_daemon(base: Path) -> Iterator[GitDaemon]:
    """`git daemon` on a free loopback port, exporting every repository under `base`."""
    base.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = subprocess.Popen(
        [
            "git",
            "daemon",
            "--reuseaddr",
            "--export-all",
            f"--base-path={base}",
            "--listen=127.0.0.1",
            f"--port={port}",
            str(base),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port("127.0.0.1", port)
        yield GitDaemon(base, port)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
