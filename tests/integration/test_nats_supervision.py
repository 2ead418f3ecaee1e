"""The private nats-server of `kbmesh up` looks after itself: restarted when it dies, on
the same port and store, and never left behind when kbmesh itself is killed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import nats
import pytest

from services.common.bus import auth as busauth
from services.common.bus.nats_server import NatsServer, ReloadRefused, reload_running
from tests.support.domain import wait_until
from tests.support.procs import ROOT


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; its state says it is gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


async def test_a_killed_server_is_restarted_with_its_data(tmp_path):
    """kill -9 of the server: the status says it is down, the supervisor starts a new
    process on the same port, a connected client reconnects by itself and finds what it
    stored before."""
    server = NatsServer(tmp_path / "nats").start()
    server.supervise()
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(bucket="probe")
        await kv.put("before", b"kept")
        first_pid = server.status()["pid"]

        os.kill(first_pid, signal.SIGKILL)

        async def down() -> bool:
            return not server.status()["running"]

        await wait_until(down, timeout=5, interval=0.01, what="the status to say down")

        async def back() -> dict:
            status = server.status()
            return status if status["running"] and nc.is_connected else {}

        status = await wait_until(back, timeout=20, what="a restarted server")
        assert status["pid"] != first_pid and status["restarts"] == 1
        assert status["last_exit_code"] == -signal.SIGKILL

        async def read_back() -> bytes | None:
            try:
                return (await (await js.key_value("probe")).get("before")).value
            except Exception:  # JetStream answers once it recovered its store
                return None

        assert await wait_until(read_back, timeout=20, what="the stored value") == b"kept"
    finally:
        await nc.close()
        server.stop()
    assert not server.status()["running"]


def test_the_server_dies_with_the_process_that_started_it(tmp_path):
    """kill -9 of its parent (what happens to a crashed `kbmesh up`) stops the server too,
    so the next start finds its port and store free."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from services.common.bus.nats_server import NatsServer
        server = NatsServer(Path({str(tmp_path / "nats")!r})).start()
        print(server.proc.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "nats-server outlived the process that started it"


async def test_a_reload_waits_for_the_servers_answer(tmp_path):
    """A change of accounts is applied by a reload that waits for nats-server's answer: a
    configuration the server refuses (two users of one name) raises ReloadRefused with the
    server's reason, and the server keeps admitting its users; a good one returns once
    applied, and a removed user is refused at once, its open connection closed."""
    users = {"alice": "a-pass", "bob": "b-pass"}

    def accounts() -> dict[str, object]:
        listed = [{"user": name, "password": password} for name, password in users.items()]
        return {"KBMESH": {"jetstream": "enabled", "users": listed}}

    with NatsServer(tmp_path / "nats", accounts=accounts) as server:
        closed = asyncio.Event()

        async def on_closed() -> None:
            closed.set()

        async def on_error(err: Exception) -> None:
            pass  # the server's parting notice

        bob = await nats.connect(
            server.url,
            user="bob",
            password="b-pass",
            allow_reconnect=False,
            closed_cb=on_closed,
            error_cb=on_error,
        )
        server.accounts = lambda: {
            **accounts(),
            "OTHER": {"users": [{"user": "alice", "password": "x"}]},
        }
        with pytest.raises(ReloadRefused, match='Duplicate user "alice"'):
            server.reload()
        assert await busauth.admits(server.url, "alice", "a-pass")

        server.accounts = accounts
        del users["bob"]
        server.reload()
        assert not await busauth.admits(server.url, "bob", "b-pass")
        await asyncio.wait_for(closed.wait(), 10)
        assert bob.is_closed
        # The same through the data directory's path: another process's server.
        users["carol"] = "c-pass"
        assert reload_running(server.store_dir, accounts())
        assert await busauth.admits(server.url, "carol", "c-pass")
