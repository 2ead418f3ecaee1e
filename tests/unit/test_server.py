"""The gateway server's deadline for a request body: a grace, plus the declared length at
the slowest rate allowed, up to the largest body the app takes."""

from __future__ import annotations

from services.gateway.server import DEADLINES, Deadlines, body_deadline

LARGEST = 21_000_000


def test_a_bodys_deadline_grows_with_its_declared_length():
    deadlines = Deadlines(body_seconds=20, min_bytes_per_second=100_000)
    assert body_deadline([(b"content-length", b"0")], deadlines, LARGEST) == 20
    assert body_deadline([(b"content-length", b"1000")], deadlines, LARGEST) == 20.01
    assert body_deadline([(b"content-length", b"20000000")], deadlines, LARGEST) == 220


def test_a_declared_length_past_the_largest_body_gets_no_more_time():
    """A client declaring 10^12 bytes gets the deadline of the largest body, not 10^7 s."""
    deadlines = Deadlines(body_seconds=20, min_bytes_per_second=100_000)
    assert body_deadline([(b"content-length", b"1000000000000")], deadlines, LARGEST) == 230


def test_a_body_of_no_declared_length_gets_the_grace_alone():
    deadlines = Deadlines(body_seconds=20)
    assert body_deadline([(b"transfer-encoding", b"chunked")], deadlines, LARGEST) == 20
    assert body_deadline([(b"content-length", b"-5")], deadlines, LARGEST) == 20


def test_the_shipped_client_deadlines_close_a_stalled_request_within_half_a_minute():
    """tests/integration/test_trust_boundary.py runs with short deadlines; these are the
    ones every gateway serves with (tests/e2e/test_browser_attacks.py meets them)."""
    assert DEADLINES.header_seconds + DEADLINES.body_seconds <= 30
