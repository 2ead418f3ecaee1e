"""The error hierarchy every service shares; transports map each class to one outcome.

KbmeshError
├── InvalidInput   permanent: HTTP 422/400, MCP tool error, dead letter
│   └── TooLarge   HTTP 413
├── NotFound       HTTP 404 (also anything in another org)
├── Forbidden      HTTP 403 (key scope, read-only keys)
├── Conflict       HTTP 409 (limits, duplicate names)
│   └── Raced      a compare-and-set lost to another writer; `compare_and_set` runs it again
├── BadModelOutput HTTP 502 (a model's answer broke the requested schema, even after repair)
└── Transient      retried with backoff; dead letter after the last try
"""

from __future__ import annotations


class KbmeshError(Exception):
    """Base of every error kbmesh raises on purpose."""

    status_code = 500
    error_type = "InternalError"
    retryable = False

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidInput(KbmeshError):
    status_code = 422
    error_type = "ValidationError"


class TooLarge(InvalidInput):
    status_code = 413
    error_type = "ContentTooLarge"


class NotFound(KbmeshError):
    status_code = 404
    error_type = "NotFound"


class Forbidden(KbmeshError):
    status_code = 403
    error_type = "Forbidden"


class Conflict(KbmeshError):
    status_code = 409
    error_type = "Conflict"


class Raced(Conflict):
    """A compare-and-set lost: the key was written after it was read. Under
    `registry.compare_and_set` the step runs again on what is there now; anywhere else it
    is a conflict like any other."""


class BadModelOutput(KbmeshError):
    """An upstream model answered, but not in the shape asked for: the request was fine and
    the service worked, so neither 4xx nor 500 — the gateway in front of it got a bad reply."""

    status_code = 502
    error_type = "BadModelOutput"


class Transient(KbmeshError):
    status_code = 503
    error_type = "Unavailable"
    retryable = True


def error_class(error_type: str) -> type[KbmeshError]:
    """The class for an `error_type` received from another service (KbmeshError if unknown).
    TooLarge comes before InvalidInput so that the more specific class wins."""
    for cls in (TooLarge, InvalidInput, NotFound, Forbidden, Conflict, BadModelOutput, Transient):
        if cls.error_type == error_type:
            return cls
    return KbmeshError
