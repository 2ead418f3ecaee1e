"""Reaching the bus of a stack under test as one of its users (the private nats-server of
`kbmesh up` admits no one else: services/common/bus/auth.py)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import nats
from opentelemetry.sdk.trace import TracerProvider

from services.common.bus.auth import Credentials, recorded_credentials
from services.common.bus.client import Bus
from services.common.bus.nats_server import free_port, nats_server_binary, wait_for_port


@contextlib.contextmanager
def nats_with_max_payload(directory: Path, max_payload: int) -> Iterator[str]:
    """A nats-server (no users) whose message limit is `max_payload` instead of the 8 MB
    kbmesh's own server allows, storing under `directory`; yields its URL."""
    port = free_port()
    config = directory / "nats.conf"
    config.write_text(
        f'listen: "127.0.0.1:{port}"\nmax_payload: {max_payload}\n'
        f'jetstream {{ store_dir: "{directory / "js"}" }}\n'
    )
    proc = subprocess.Popen(
        [nats_server_binary(), "-c", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port("127.0.0.1", port)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def credentials(data_dir: Path, role: str) -> Credentials:
    found = recorded_credentials(data_dir, role)
    if found is None:
        raise AssertionError(f"no {role} credentials in {data_dir}")
    return found


def bus_env(rt: Any, role: str = "gateway") -> dict[str, str]:
    """Environment for a kbmesh subprocess joining the stack of runtime `rt` as `role`."""
    creds = credentials(rt.settings.data_dir, role)
    return {
        "KBMESH_NATS_URL": rt.bus.url,
        "KBMESH_NATS__USER": creds.user,
        "KBMESH_NATS__PASSWORD": creds.password,
    }


def bus_url(url: str, data_dir: Path, role: str = "operator") -> str:
    """`url` with `role`'s credentials in it, for a plain nats-py client."""
    creds = credentials(data_dir, role)
    parsed = urlparse(url)
    return f"nats://{creds.user}:{creds.password}@{parsed.hostname}:{parsed.port}"


@contextlib.asynccontextmanager
async def as_operator(rt: Any) -> AsyncIterator[nats.NATS]:
    """A connection to the bus of runtime `rt` as its operator (anonymous on a NATS without
    users): for what no service may do, such as reading the dead-letter stream with a
    consumer of its own."""
    found = recorded_credentials(rt.settings.data_dir, "operator")
    url = bus_url(rt.bus.url, rt.settings.data_dir) if found else rt.bus.url
    nc = await nats.connect(url)
    try:
        yield nc
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def operator_bus(rt: Any) -> AsyncIterator[Bus]:
    """The stack's bus as `kbmesh backup` reaches it: as the operator's user."""
    bus = Bus(rt.bus.url, TracerProvider(), credentials(rt.settings.data_dir, "operator"))
    await bus.connect()
    try:
        yield bus
    finally:
        await bus.close()


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching, as the server applies permissions: `*` is one token, `>` one
    or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


class OperatorKeys:
    """`kbmesh keys create` in-process: API keys are written as the operator's NATS user, the
    only one allowed to (a stack's own connection is refused)."""

    def __init__(self, rt: Any) -> None:
        self.url = bus_url(rt.bus.url, rt.settings.data_dir, "operator")
        self.default_org = rt.settings.default_org

    async def create(
        self,
        org_id: str,
        name: str = "",
        kb_ids: list[str] | None = None,
        read_only: bool = False,
    ) -> str:
        from services.common.bus.audit import sink as audit_sink
        from services.common.bus.registry import ApiKey, Registry
        from services.gateway.auth import KeyResolver

        nc = await nats.connect(self.url)
        try:
            js = nc.jetstream()
            kv = await js.key_value("keys")
            # The creation goes on the audit trail, as `kbmesh keys create`'s does.
            resolver = KeyResolver(
                Registry(kv, ApiKey), self.default_org, audit=audit_sink(lambda: js)
            )
            return await resolver.create(org_id, name, kb_ids, read_only)
        finally:
            await nc.close()
