"""A three-node NATS JetStream cluster on loopback: real nats-server processes with their own
stores, routed to each other, that a test can kill and restart one by one."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx
import nats

from services.common.bus.nats_server import free_port, nats_server_binary, wait_for_port


class ClusterNode:
    def __init__(self, name: str, root: Path, client_port: int, route_port: int) -> None:
        self.name = name
        self.dir = root / name
        self.client_port = client_port
        self.route_port = route_port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    def configure(self, routes: list[int]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        route_urls = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in routes)
        (self.dir / "nats.conf").write_text(
            f'server_name: "{self.name}"\n'
            f'listen: "127.0.0.1:{self.client_port}"\n'
            "max_payload: 8388608\n"
            f'jetstream {{ store_dir: "{self.dir / "store"}" }}\n'
            "cluster {\n"
            '  name: "kbmesh"\n'
            f'  listen: "127.0.0.1:{self.route_port}"\n'
            f"  routes: [{route_urls}]\n"
            "}\n"
        )

    def start(self) -> None:
        log = open(self.dir / "nats.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(self.dir / "nats.conf")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        wait_for_port("127.0.0.1", self.client_port)

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


class NatsCluster:
    """`url` lists every node, the way services are configured against a cluster."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.nodes = [ClusterNode(f"n{i + 1}", root, free_port(), free_port()) for i in range(size)]
        for node in self.nodes:
            node.configure([n.route_port for n in self.nodes if n is not node])

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def __enter__(self) -> NatsCluster:
        for node in self.nodes:
            node.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            node.stop()


async def jetstream_ready(url: str) -> bool:
    """True once the cluster elected its JetStream meta leader and answers API calls."""
    try:
        nc = await nats.connect(url.split(","), max_reconnect_attempts=1, connect_timeout=1)
    except Exception:
        return False
    try:
        await nc.jetstream().account_info()
        return True
    except Exception:
        return False
    finally:
        await nc.close()


def upload(client: httpx.Client, body: dict[str, str], statuses: list[int]) -> None:
    """A client that retries what the API says is temporary (503 with Retry-After), and
    connection errors; the explicit document id makes a retry replace, never duplicate."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            r = client.post("/v1/kbs/default/documents", json=body)
        except httpx.TransportError:
            time.sleep(0.5)
            continue
        statuses.append(r.status_code)
        if r.status_code == 202:
            return
        assert r.status_code == 503, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        time.sleep(min(float(r.headers["retry-after"]), 2.0))
    raise TimeoutError(f"{body['document_id']} not accepted in 120 s")
