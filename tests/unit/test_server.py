"""The gateway server's deadline for a request body: a grace, plus the declared length at
the slowest rate allowed, up to the largest body the app takes."""

from __future__ import annotations

from services.common.settings import HttpSettings
from services.gateway.server import body_deadline

LARGEST = 21_000_000


def test_a_bodys_deadline_grows_with_its_declared_length():
    limits = HttpSettings(body_timeout_seconds=20, body_min_bytes_per_second=100_000)
    assert body_deadline([(b"content-length", b"0")], limits, LARGEST) == 20
    assert body_deadline([(b"content-length", b"1000")], limits, LARGEST) == 20.01
    assert body_deadline([(b"content-length", b"20000000")], limits, LARGEST) == 220


def test_a_declared_length_past_the_largest_body_gets_no_more_time():
    """A client declaring 10^12 bytes gets the deadline of the largest body, not 10^7 s."""
    limits = HttpSettings(body_timeout_seconds=20, body_min_bytes_per_second=100_000)
    assert body_deadline([(b"content-length", b"1000000000000")], limits, LARGEST) == 230


def test_a_body_of_no_declared_length_gets_the_grace_alone():
    limits = HttpSettings(body_timeout_seconds=20)
    assert body_deadline([(b"transfer-encoding", b"chunked")], limits, LARGEST) == 20
    assert body_deadline([(b"content-length", b"-5")], limits, LARGEST) == 20
