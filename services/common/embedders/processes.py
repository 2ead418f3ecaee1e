"""The document encoder's process pool: document batches embed in child processes that run
below every other process's CPU priority, so a search never waits for a batch on a busy
machine (the batch only finishes a little later; docs/benchmarks.md, "Method")."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from services.common.domain.errors import Transient
from services.common.embedders.engine import Encoder

# Kept for systems without Linux's SCHED_IDLE, which the children take where it exists.
NICENESS = 10
_encoder: Encoder | None = None  # a child's own


def document_workers(cores: int, processes: int = 0, *, most: int = 4) -> tuple[int, int]:
    """(child processes, threads each) on `cores` cores; `processes` above 0 is an operator's
    choice. One single-threaded child per core up to `most`: the threads of one run wait for
    each other at every operator, so the server's other work taking a core a moment would
    stall all of a multi-threaded child; beyond `most`, threads, which bounds memory."""
    processes = processes or max(1, min(cores, most))
    return processes, max(1, cores // processes)


def _exit_with(parent: int) -> None:
    """A server killed outright (`kill -9`) runs no cleanup: without this its children would
    go on computing batches nobody waits for, beside the server that replaces it."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _start_child(factory: Callable[[], Encoder], server: int) -> None:
    global _encoder
    # `server` from the server: a child still starting as it died would see init as parent.
    threading.Thread(target=_exit_with, args=(server,), daemon=True).start()
    os.nice(NICENESS)
    if hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    _encoder = factory()
    _encoder.encode(["warm up"], query=False)


def _started() -> int:
    time.sleep(0.2)
    return os.getpid()


def _encode(texts: list[str]) -> np.ndarray:
    assert _encoder is not None
    return _encoder.encode(texts, query=False)


class ProcessEncoder:
    """`processes` children (fresh interpreters: spawned, not forked from a threaded server)
    that each build `factory()`'s encoder; each call goes to a free one. A child that dies
    fails the calls in flight as transient (their messages are redelivered), and the next
    call starts the children again."""

    def __init__(
        self, factory: Callable[[], Encoder], processes: int = 1, *, start: bool = True
    ) -> None:
        self._factory, self.processes = factory, processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        if start:
            self._open()

    def _open(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.processes,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_child,
                    initargs=(self._factory, os.getpid()),
                )
                # One call each starts them all now, not at the first batches; each call
                # lasts a moment, so that every child (its initializer run) takes one.
                calls = [self._pool.submit(_started) for _ in range(self.processes)]
                try:
                    for call in calls:
                        call.result()
                except BrokenProcessPool as err:
                    self._pool.shutdown(wait=False, cancel_futures=True)
                    self._pool = None
                    raise RuntimeError(f"document encoder failed to start: {err!r}") from err
            return self._pool

    def pids(self) -> list[int]:
        return list(getattr(self._pool, "_processes", None) or {})

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        try:
            pool = self._open()
            return pool.submit(_encode, texts).result()
        except BrokenProcessPool as err:
            with self._lock:
                broken, self._pool = self._pool, None
            if broken is not None:
                broken.shutdown(wait=False, cancel_futures=True)
            raise Transient(f"a document encoder process stopped: {err!r}") from err

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
