"""Extraction in child processes, each bounded in memory and time, so that a hostile or broken
document (a decompression bomb, a parser stuck in a loop) fails alone and the serving process
neither grows nor stalls.

pebble's process pool runs `extract.extract` in spawned children. Each child caps its own
address space (RLIMIT_AS) and runs below every other process (SCHED_IDLE), so searches keep
their latency while a document is read. The time limit is CPU time (a profiling timer, set
afresh for each document): a reader that runs only when the cores are otherwise idle must
not fail a document because the machine was busy. A document that burns its CPU seconds is
killed with its process, which the pool replaces; a wall-clock backstop of `WALL_FACTOR`
times the limit catches a reader that waits instead of computing. `failure` says what each
way of failing means for the document.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from pebble import ProcessExpired, ProcessPool

from services.common.domain.errors import InvalidInput, KbmeshError, Transient
from services.common.domain.limits import LimitSettings
from services.ingest.extract import Bounds, Extracted, NeedsOcr, extract, first_line

log = logging.getLogger("kbmesh.ingest")
SETTING = "KBMESH_LIMITS__"
# Lower CPU priority of the children than the serving process (0 = the same).
CHILD_NICENESS = 10
# A child is replaced after this many documents: whatever a parser leaked goes with it.
TASKS_PER_CHILD = 100
# The wall-clock backstop, in multiples of the CPU-time limit.
WALL_FACTOR = 10


class ExtractionFailed(InvalidInput):
    """The document took more memory or time than a document may, or the reader failed on
    it: permanent, since the same bytes fail the same way again."""


def failure(err: BaseException, limits: LimitSettings) -> KbmeshError:
    """What a failed reading means for the document: the one place that decides. Runs in
    the child for what the reader raised, in the serving process for what became of the
    child. (kbmesh's own refusals, such as TooLarge for what a zip inflates to, never come
    here: they stand as they are.)

    A limit the document broke (memory, CPU time) or a reader that failed on it (an
    exception outside kreuzberg's own, a panic, its process dying) is permanent: the same
    bytes fail the same way, so the document fails on its first delivery (422, dead
    letter). Only a broken pool is transient: the next try gets a new one."""
    memory = f"over the limit of {limits.extract_memory_mb} MB ({SETTING}EXTRACT_MEMORY_MB)"
    if isinstance(err, FutureTimeout) or (
        isinstance(err, ProcessExpired) and err.exitcode == -signal.SIGPROF
    ):
        return ExtractionFailed(
            f"reading the document took longer than {limits.extract_seconds:g} s of CPU time "
            f"and was stopped ({SETTING}EXTRACT_SECONDS)",
            field="content",
        )
    if isinstance(err, MemoryError):
        return ExtractionFailed(
            f"reading the document ran out of memory: {memory}", field="content"
        )
    if isinstance(err, ProcessExpired):
        # Killed by the kernel: most often an allocation past RLIMIT_AS in native code (Rust
        # aborts on one), or the machine's out-of-memory killer.
        return ExtractionFailed(
            f"the reader's process died ({_exit(err.exitcode)}) reading the document: most "
            f"often it ran out of memory, {memory}; else the reader crashed on it",
            field="content",
        )
    if isinstance(err, BrokenProcessPool):
        return Transient(
            f"the document readers' process pool broke ({first_line(err)}); reading again"
        )
    return ExtractionFailed(
        f"the reader failed on this document: {type(err).__name__}: {first_line(err)}",
        field="content",
    )


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return f"exit code {code}"


def _limit_child(memory_bytes: int) -> None:
    """Runs first in every child: cap its address space, yield the CPU to the services."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    with contextlib.suppress(OSError):  # a platform that refuses niceness runs at ours
        os.nice(CHILD_NICENESS)
    # Below every other process where Linux has it (as the document encoder's children): a
    # search never waits for a document being read, only the reading waits.
    if hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    import kreuzberg  # noqa: F401  loaded once per child, not per document


def _run(data: bytes, declared: str | None, name: str, limits: LimitSettings) -> Extracted:
    # This document's CPU seconds, counted by the kernel for the whole child; when they run
    # out it sends SIGPROF, which ends the child. (RLIMIT_CPU counts whole seconds of the
    # child's life, so it allowed up to a second more than the limit.)
    signal.setitimer(signal.ITIMER_PROF, limits.extract_seconds)
    try:
        return extract(data, declared, name, _bounds(limits))
    except (NeedsOcr, KbmeshError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:
        # Decided here, so that only kbmesh's errors cross back: a reader's own exception
        # (pyo3's PanicException is a BaseException) may not unpickle in the serving
        # process, which would read as a broken pool and be retried.
        raise failure(err, limits) from None
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)


def _bounds(limits: LimitSettings) -> Bounds:
    return Bounds(
        expanded_bytes=limits.extract_expanded_bytes,
        expansion_ratio=limits.extract_expansion_ratio,
    )


class Extractor:
    """Reads documents in a pool of bounded child processes."""

    def __init__(self, limits: LimitSettings) -> None:
        self.limits = limits
        self._pool: ProcessPool | None = None

    def _started(self) -> ProcessPool:
        if self._pool is None or not self._pool.active:
            self._pool = ProcessPool(
                max_workers=self.limits.extract_workers,
                max_tasks=TASKS_PER_CHILD,
                initializer=_limit_child,
                initargs=(self.limits.extract_memory_mb * 1024 * 1024,),
                # spawn: a fork of a serving process would copy its threads' locks and its
                # memory; a spawned child imports only the extraction code.
                context=multiprocessing.get_context("spawn"),
            )
        return self._pool

    def start(self) -> None:
        """Spawn the children now: each imports the readers (about a second), which would
        otherwise hold up the first document."""
        self._started().schedule(os.getpid)

    async def extract(self, data: bytes, declared: str | None, name: str) -> Extracted:
        """The document's text and layout; NeedsOcr when it has no text layer; otherwise
        the error `failure` makes of what went wrong."""
        try:
            return await asyncio.wrap_future(self._schedule(data, declared, name))
        except (NeedsOcr, KbmeshError):
            raise
        except Exception as err:
            refused = failure(err, self.limits)
            if isinstance(err, ProcessExpired):
                log.warning("extraction child died name=%s exitcode=%s", name, err.exitcode)
            raise refused from err

    def _schedule(self, data: bytes, declared: str | None, name: str) -> Future[Extracted]:
        try:
            return self._started().schedule(
                _run,
                args=(data, declared, name, self.limits),
                timeout=self.limits.extract_seconds * WALL_FACTOR,
            )
        except RuntimeError as err:  # pebble's pool broke after `_started` looked at it
            raise BrokenProcessPool(str(err)) from err

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None
