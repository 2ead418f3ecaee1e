"""Git servers on loopback for git sources: `git daemon` serving the repositories under one
directory, smart HTTP (`git http-backend`) behind a token, and a working repository to
commit to."""

from __future__ import annotations

import base64
import contextlib
import http.server
import subprocess
import threading
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


class _Backend(http.server.BaseHTTPRequestHandler):
    """`git http-backend` (smart HTTP) behind basic authentication: the password must be
    the server's token."""

    root: Path
    token: str
    seen_authorization: list[str]

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def _serve(self) -> None:
        auth = self.headers.get("Authorization", "")
        self.seen_authorization.append(auth)
        user_pass = base64.b64decode(auth.removeprefix("Basic ") or b"").decode(errors="replace")
        if not auth.startswith("Basic ") or user_pass.partition(":")[2] != self.token:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        env = {
            "GIT_PROJECT_ROOT": str(self.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "REQUEST_METHOD": self.command,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_USER": "git",
            "PATH": "/usr/bin:/bin",
        }
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        done = subprocess.run(
            ["git", "http-backend"], input=body, env=env, capture_output=True, check=False
        )
        head, _, payload = done.stdout.partition(b"\r\n\r\n")
        status = 200
        headers = []
        for line in head.decode().split("\r\n"):
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@dataclass
class HttpGit:
    url: str  # of the server; repositories under it by name
    seen_authorization: list[str]


@contextlib.contextmanager
def git_http(root: Path, token: str) -> Iterator[HttpGit]:
    """Smart HTTP git on a free loopback port, for the repositories under `root`, admitting
    a client whose basic-auth password is `token`."""
    seen: list[str] = []
    fields = {"root": root, "token": token, "seen_authorization": seen}
    handler = type("Backend", (_Backend,), fields)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield HttpGit(f"http://127.0.0.1:{server.server_address[1]}", seen)
    finally:
        server.shutdown()
        server.server_close()
