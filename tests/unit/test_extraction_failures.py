"""What a failed reading means for its document (services/ingest/sandbox.py `failure`): a
broken limit or a failed reader is permanent, with the setting or the reader's reason named;
only a broken process pool is retried."""

from __future__ import annotations

import signal
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

import pytest
from pebble import ProcessExpired

from services.common.domain.errors import InvalidInput, Transient
from services.common.domain.limits import LimitSettings
from services.ingest.sandbox import ExtractionFailed, failure

LIMITS = LimitSettings()


class PanicException(BaseException):
    """Shaped as pyo3's, which a Rust reader raises when it panics: not an Exception."""


@pytest.mark.parametrize(
    ("err", "said"),
    [
        (MemoryError(), "KBMESH_LIMITS__EXTRACT_MEMORY_MB"),
        (FutureTimeout(), "KBMESH_LIMITS__EXTRACT_SECONDS"),
        (ProcessExpired("gone", code=-signal.SIGPROF), "KBMESH_LIMITS__EXTRACT_SECONDS"),
        (ProcessExpired("gone", code=-signal.SIGABRT), "SIGABRT"),
        (ProcessExpired("gone", code=-signal.SIGSEGV), "KBMESH_LIMITS__EXTRACT_MEMORY_MB"),
        (ProcessExpired("gone", code=1), "exit code 1"),
        (OSError("Invalid checksum"), "OSError: Invalid checksum"),
        (RuntimeError("index out of range\nat slide 3"), "RuntimeError: index out of range"),
        (PanicException("called `Option::unwrap()` on a `None` value"), "PanicException"),
    ],
)
def test_limits_and_reader_failures_fail_the_document_for_good(err: BaseException, said: str):
    """Each is answered 422 on the first delivery (not retryable), naming what to change or
    what the reader said."""
    refused = failure(err, LIMITS)
    assert isinstance(refused, ExtractionFailed) and isinstance(refused, InvalidInput)
    assert not refused.retryable and refused.status_code == 422
    assert said in refused.message, refused.message
    assert refused.field == "content"


def test_only_a_broken_pool_is_retried():
    refused = failure(BrokenProcessPool("Unpicklable object from worker"), LIMITS)
    assert isinstance(refused, Transient) and refused.retryable
