"""The document encoder's process pool: document batches embed in child processes that run
below every other process's CPU priority, so a search never waits for a batch on a busy
machine (the batch only finishes a little later; docs/benchmarks.md, "Search during an
ingest"). Run as `python -m services.common.embedders.processes`, a module is one such child:
it receives an encoder factory on stdin, builds it, then answers each batch of texts with
their vectors on stdout until stdin closes."""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np

from services.common.embedders.engine import Encoder
from services.common.errors import Transient

# Kept for systems without Linux's SCHED_IDLE, which the children take where it exists.
NICENESS = 10


def document_workers(cores: int, processes: int = 0, *, most: int = 4) -> tuple[int, int]:
    """(child processes, threads each) on `cores` cores; `processes` above 0 is an operator's
    choice, the cores shared among them. One single-threaded child per core up to `most`:
    the threads of one run wait for each other at every operator, so a core taken a moment
    by the server's other work (chunking, BM25, storing) would stall every thread of a
    multi-threaded child; beyond that, several threads each, which bounds memory."""
    processes = processes or max(1, min(cores, most))
    return processes, max(1, cores // processes)


class ProcessEncoder:
    """An encoder run in a child process: a fresh interpreter (`python -m`) that ends when
    its pipe closes, so it never outlives this process; one that died is started again on
    the next call, and the call in flight fails as transient (its messages are redelivered)."""

    def __init__(self, factory: Callable[[], Encoder], *, start: bool = True) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._send: Connection | None = None
        self._receive: Connection | None = None
        self.kind = "not started"  # the child's encoder's `kind` once it is ready
        if start:
            self._start()

    def _start(self) -> None:
        child = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"},
        )
        assert child.stdin is not None and child.stdout is not None
        send = Connection(os.dup(child.stdin.fileno()), readable=False)
        receive = Connection(os.dup(child.stdout.fileno()), writable=False)
        child.stdin.close()
        child.stdout.close()
        try:
            send.send(self._factory)
            status, detail = receive.recv()
        except (EOFError, OSError) as err:
            status, detail = "error", repr(err)
        if status != "ready":
            send.close()
            receive.close()
            child.wait(10)
            raise RuntimeError(f"document encoder failed to start: {detail}")
        self._child, self._send, self._receive = child, send, receive
        self.kind = str(detail)

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        with self._lock:
            if self._child is None or self._child.poll() is not None:
                self._start()
            assert self._send is not None and self._receive is not None
            try:
                self._send.send(texts)
                status, payload = self._receive.recv()
            except (EOFError, OSError) as err:
                self._child = None
                raise Transient(f"the document encoder process stopped: {err!r}") from err
        if status != "ok":
            raise RuntimeError(payload)
        return np.asarray(payload, dtype=np.float32)

    def close(self) -> None:
        with self._lock:
            for conn in (self._send, self._receive):
                if conn is not None:
                    conn.close()
            if self._child is not None:
                try:
                    self._child.wait(5)
                except subprocess.TimeoutExpired:
                    self._child.kill()


class EncoderGroup:
    """Several child processes behind one encoder: each call takes a free one."""

    def __init__(self, members: list[ProcessEncoder]) -> None:
        self._free: queue.SimpleQueue[ProcessEncoder] = queue.SimpleQueue()
        self.members = members
        for member in members:
            self._free.put(member)

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        member = self._free.get()
        try:
            return member.encode(texts, query=query)
        finally:
            self._free.put(member)


def serve() -> None:
    """A child's life: below everything else, then batches until the parent closes the pipe."""
    os.nice(NICENESS)
    if hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    out = os.dup(1)
    os.dup2(2, 1)  # stray prints of libraries go to stderr, not into the pipe
    receive = Connection(os.dup(0), writable=False)
    send = Connection(out, readable=False)
    try:
        encoder = receive.recv()()
        encoder.encode(["warm up"], query=False)
    except BaseException as err:  # reported to the parent, which fails its start
        send.send(("error", repr(err)))
        return
    send.send(("ready", getattr(encoder, "kind", type(encoder).__name__)))
    while True:
        try:
            texts = receive.recv()
        except (EOFError, OSError):
            return
        try:
            send.send(("ok", encoder.encode(texts, query=False)))
        except Exception as err:
            send.send(("error", repr(err)))


if __name__ == "__main__":
    serve()
