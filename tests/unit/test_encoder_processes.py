"""The document encoder's children never outlive their server: killed outright (`kill -9`,
no cleanup runs), its children exit on their own within seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support.procs import ROOT


class ConstantEncoder:
    """A stand-in model (this test is about processes, not vectors): one fixed row a text."""

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        return np.ones((len(texts), 4), dtype=np.float32) / 2.0


SERVER = """
import sys, time
from services.common.embedders.processes import ProcessEncoder
from tests.unit.test_encoder_processes import ConstantEncoder
pool = ProcessEncoder(ConstantEncoder, processes=2)
pool.encode(["a text"], query=False)
print(" ".join(map(str, pool.pids())), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A child that exited but is not reaped yet (its parent is gone: init reaps it) is a
    # zombie; it computes nothing.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# Killed before its child has started: the child is still importing as its server dies.
SERVER_KILLED_EARLY = """
import threading, time
from services.common.embedders.processes import ProcessEncoder
from tests.unit.test_encoder_processes import ConstantEncoder
pool = ProcessEncoder(ConstantEncoder, processes=1, start=False)
threading.Thread(target=pool._open, daemon=True).start()
while not pool.pids():
    time.sleep(0.01)
print(" ".join(map(str, pool.pids())), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("script", "processes"), [(SERVER, 2), (SERVER_KILLED_EARLY, 1)], ids=["started", "starting"]
)
def test_children_exit_when_their_server_is_killed(script: str, processes: int) -> None:
    server = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        children = [int(p) for p in server.stdout.readline().split()]
        assert len(children) == processes and all(alive(p) for p in children)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in children if alive(p)]
        assert not left, f"children outlived their server: {left}"
    finally:
        server.kill()
