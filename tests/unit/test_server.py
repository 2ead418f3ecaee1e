"""The gateway server's deadline for a request body: a grace, plus the declared length at
the slowest rate allowed."""

from __future__ import annotations

from services.gateway.server import DEADLINES, Deadlines, body_deadline


def test_a_bodys_deadline_grows_with_its_declared_length():
    deadlines = Deadlines(body_seconds=20, min_bytes_per_second=100_000)
    assert body_deadline([(b"content-length", b"0")], deadlines) == 20
    assert body_deadline([(b"content-length", b"1000")], deadlines) == 20.01
    assert body_deadline([(b"content-length", b"20000000")], deadlines) == 220


def test_a_body_of_no_declared_length_gets_the_grace_alone():
    deadlines = Deadlines(body_seconds=20)
    assert body_deadline([(b"transfer-encoding", b"chunked")], deadlines) == 20
    assert body_deadline([(b"content-length", b"-5")], deadlines) == 20


def test_the_shipped_client_deadlines_close_a_stalled_request_within_half_a_minute():
    """tests/integration/test_trust_boundary.py runs with short deadlines; these are the
    ones every gateway serves with (tests/e2e/test_browser_attacks.py meets them)."""
    assert DEADLINES.header_seconds + DEADLINES.body_seconds <= 30
