"""Slow and greedy clients against `kbmesh up`: how long requests that never finish hold the
gateway, whether it keeps answering meanwhile, and what unauthenticated large bodies cost its
memory. Prints one line per figure.

    python -m benchmarks.slow_clients [--connections 2000] [--bodies 6] [--body-mb 100]

The half-sent run turns the per-client connection cap off (`KBMESH_HTTP__CONNECTIONS_PER_
CLIENT=0`), so every connection is closed by the deadlines alone; a second run with the
default cap shows how many it answers 503 at once.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import ROOT, bench_env
from services.common.bus.nats_server import free_port

KBMESH = [sys.executable, "-m", "services.cli"]
HALF_HEADERS = b"POST /v1/kbs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Up:
    """`kbmesh up` on a temporary data dir, with its process id."""

    def __init__(self, **env: str) -> None:
        self.data = tempfile.TemporaryDirectory()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [*KBMESH, "up", "--data-dir", self.data.name, "--port", str(self.port)],
            cwd=ROOT,
            env=bench_env(**env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("kbmesh up did not become ready")

    def key(self) -> str:
        out = subprocess.run(
            [*KBMESH, "keys", "create", "--org", "local", "--data-dir", self.data.name],
            cwd=ROOT,
            env=bench_env(),
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip().splitlines()[-1]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.data.cleanup()


async def half_sent(port: int, payload: bytes, started: float) -> tuple[float, bytes]:
    """Open, send `payload`, wait for the server to close; (seconds since `started`, the
    first bytes it sent)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    try:
        answer = await reader.read()
    except ConnectionError:
        answer = b""
    writer.close()
    return time.monotonic() - started, answer[:12]


async def attack(up: Up, connections: int) -> None:
    body_head = (
        f"POST /v1/kbs HTTP/1.1\r\nHost: 127.0.0.1:{up.port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    ).encode()
    started = time.monotonic()
    payloads = [HALF_HEADERS if i % 2 else body_head for i in range(connections)]
    tasks = [asyncio.create_task(half_sent(up.port, p, started)) for p in payloads]
    await asyncio.sleep(2)
    async with httpx.AsyncClient(base_url=up.base, timeout=30) as http:
        probe = time.monotonic()
        status = (await http.get("/healthz")).status_code
        print(f"  /healthz during the attack: {status} in {time.monotonic() - probe:.3f} s")
    results = await asyncio.gather(*tasks, return_exceptions=True)
    closed = [r for r in results if isinstance(r, tuple)]
    errors = len(results) - len(closed)
    times = sorted(t for t, _ in closed)
    kinds: dict[bytes, int] = {}
    for _, first in closed:
        kinds[first[:12]] = kinds.get(first[:12], 0) + 1
    within = sum(t <= 30 for t in times)
    print(
        f"  {connections} half-sent requests: {within} closed within 30 s, last after "
        f"{times[-1]:.1f} s, median {times[len(times) // 2]:.1f} s; {errors} client errors; "
        f"answers {dict(sorted(kinds.items()))}"
    )


async def big_bodies(up: Up, count: int, size_mb: int) -> None:
    """`count` unauthenticated uploads of `size_mb` MB each, sent as fast as the server
    takes them, at once; the gateway's RSS before and at its peak."""
    up.key()  # keys exist: the uploads carry none
    await asyncio.sleep(1)
    before = rss_mb(up.proc.pid)
    peak = before
    size = size_mb * 1024 * 1024
    chunk = b"a" * (1024 * 1024)

    async def one() -> tuple[bytes, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", up.port)
        head = (
            f"POST /v1/documents HTTP/1.1\r\nHost: 127.0.0.1:{up.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
        )
        writer.write(head.encode())
        sent = 0
        try:
            while sent < size:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
        except ConnectionError:
            pass
        try:
            answer = await reader.read(64)
        except ConnectionError:
            answer = b""
        writer.close()
        return answer[:12], sent

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_mb(up.proc.pid))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    results = await asyncio.gather(*(one() for _ in range(count)))
    await asyncio.sleep(0.5)
    sampler.cancel()
    sent_mb = sum(s for _, s in results) / 1024 / 1024
    print(
        f"  {count} unauthenticated {size_mb} MB uploads: answers {[a for a, _ in results]}, "
        f"{sent_mb:.0f} MB sent before the server closed; RSS {before:.0f} MB before, "
        f"peak {peak:.0f} MB (+{peak - before:.0f} MB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--bodies", type=int, default=6)
    parser.add_argument("--body-mb", type=int, default=100)
    args = parser.parse_args()
    for label, env in (
        ("deadlines alone (no per-client cap)", {"KBMESH_HTTP__CONNECTIONS_PER_CLIENT": "0"}),
        ("default settings", {}),
    ):
        print(label)
        up = Up(**env)
        try:
            asyncio.run(attack(up, args.connections))
            if not env:
                asyncio.run(big_bodies(up, args.bodies, args.body_mb))
        finally:
            up.stop()


if __name__ == "__main__":
    main()
