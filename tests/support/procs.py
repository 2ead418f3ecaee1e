"""Running kbmesh as real processes, the way operators do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from services.common.bus.nats_server import free_port

KBMESH = [sys.executable, "-m", "services.cli"]
ROOT = Path(__file__).resolve().parents[2]


def kbmesh_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KBMESH_")}
    # The one exception: the shared, content-addressed model cache (tests/conftest.py).
    if "KBMESH_MODEL_CACHE_DIR" in os.environ:
        env["KBMESH_MODEL_CACHE_DIR"] = os.environ["KBMESH_MODEL_CACHE_DIR"]
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class Proc:
    """A kbmesh subprocess with its output in a log file (read it when a test fails)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self._out = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            KBMESH + args,
            cwd=ROOT,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        return self.proc.returncode

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._out.close()


def wait_ready(base: str, proc: Proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"kbmesh exited early:\n{proc.output()[-4000:]}")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"not ready after {timeout}s:\n{proc.output()[-4000:]}")


def wait_for_line(proc: Proc, text: str, timeout: float = 120) -> None:
    """Wait until `proc` has written `text` (a line it prints or logs), failing at once with
    its output if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in proc.output():
            return
        if proc.proc.poll() is not None:
            raise RuntimeError(f"kbmesh exited before {text!r}:\n{proc.output()[-4000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"no {text!r} after {timeout}s:\n{proc.output()[-4000:]}")


def wait_started(proc: Proc, services: str, timeout: float = 120) -> None:
    """Wait for a `kbmesh serve` worker's readiness: the line it prints once it consumes."""
    wait_for_line(proc, f"kbmesh {services} ready", timeout)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.3):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


__all__ = [
    "Proc",
    "free_port",
    "kbmesh_env",
    "wait_for_line",
    "wait_ready",
    "wait_started",
    "wait_until",
]
