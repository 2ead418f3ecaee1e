"""Extraction in child processes, each bounded in memory and time, so that a hostile or broken
document (a decompression bomb, a parser stuck in a loop) fails alone and the serving process
neither grows nor stalls.

pebble's process pool runs `extract.extract` in spawned children. Each child caps its own
address space (RLIMIT_AS) and runs below every other process (SCHED_IDLE), so searches keep
their latency while a document is read. The time limit is CPU time (a profiling timer, set
afresh for each document): a reader that runs only when the cores are otherwise idle must
not fail a document because the machine was busy. A document that burns its CPU seconds is
killed with its process, which the pool replaces; a wall-clock backstop of `WALL_FACTOR`
times the limit catches a reader that waits instead of computing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
from concurrent.futures import TimeoutError as FutureTimeout

from pebble import ProcessExpired, ProcessPool

from services.common.domain.errors import InvalidInput
from services.common.domain.limits import LimitSettings
from services.ingest.extract import Bounds, Extracted, extract

log = logging.getLogger("kbmesh.ingest")
SETTING = "KBMESH_LIMITS__"
# Lower CPU priority of the children than the serving process (0 = the same).
CHILD_NICENESS = 10
# A child is replaced after this many documents: whatever a parser leaked goes with it.
TASKS_PER_CHILD = 100
# The wall-clock backstop, in multiples of the CPU-time limit.
WALL_FACTOR = 10


def _too_long(seconds: float) -> ExtractionFailed:
    return ExtractionFailed(
        f"reading the document took longer than {seconds:g} s of CPU time and was stopped "
        f"({SETTING}EXTRACT_SECONDS)",
        field="content",
    )


class ExtractionFailed(InvalidInput):
    """The document took more memory or time than a document may."""


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


def _run(
    data: bytes, declared: str | None, name: str, bounds: Bounds, cpu_seconds: float
) -> Extracted:
    # This document's CPU seconds, counted by the kernel for the whole child; when they run
    # out it sends SIGPROF, which ends the child. (RLIMIT_CPU counts whole seconds of the
    # child's life, so it allowed up to a second more than the limit.)
    signal.setitimer(signal.ITIMER_PROF, cpu_seconds)
    try:
        return extract(data, declared, name, bounds)
    except MemoryError as err:
        raise ExtractionFailed("reading the document ran out of memory") from err
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)


class Extractor:
    """Reads documents in a pool of bounded child processes."""

    def __init__(self, limits: LimitSettings) -> None:
        self.limits = limits
        self.bounds = Bounds(
            expanded_bytes=limits.extract_expanded_bytes,
            expansion_ratio=limits.extract_expansion_ratio,
        )
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
        """The document's text and layout; InvalidInput (or its ExtractionFailed) when it
        cannot be read within the limits, NeedsOcr when it has no text layer."""
        seconds = self.limits.extract_seconds
        future = self._started().schedule(
            _run, args=(data, declared, name, self.bounds, seconds), timeout=seconds * WALL_FACTOR
        )
        try:
            return await asyncio.wrap_future(future)
        except FutureTimeout as err:
            raise _too_long(seconds) from err
        except ProcessExpired as err:
            if err.exitcode == -signal.SIGPROF:
                raise _too_long(seconds) from err
            # Killed by the kernel: most often an allocation past RLIMIT_AS in native code.
            log.warning("extraction child died name=%s exitcode=%s", name, err.exitcode)
            raise ExtractionFailed(
                f"reading the document exceeded the memory limit of "
                f"{self.limits.extract_memory_mb} MB, or crashed the reader "
                f"({SETTING}EXTRACT_MEMORY_MB)",
                field="content",
            ) from err
        except ExtractionFailed as err:
            raise ExtractionFailed(
                f"{err.message}: over the limit of {self.limits.extract_memory_mb} MB "
                f"({SETTING}EXTRACT_MEMORY_MB)",
                field="content",
            ) from err

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None
