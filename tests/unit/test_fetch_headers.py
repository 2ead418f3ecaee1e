"""What a fetched page's headers say about it: the file name of `Content-Disposition`
(RFC 6266, with RFC 2231's encoded and continued names) and the charset of `Content-Type`,
read as the standards write them, not by pattern."""

from __future__ import annotations

import httpx
import pytest

from services.common.outbound.fetch import name_from, to_utf8

PAGE = httpx.URL("https://docs.example/guides/setup.md")


@pytest.mark.parametrize(
    ("disposition", "name"),
    [
        ("attachment; filename=report.pdf", "report.pdf"),
        ('attachment; filename="Q1;Q2 report.md"', "Q1;Q2 report.md"),
        ("attachment; filename*=UTF-8''na%C3%AFve%20notes.md", "naïve notes.md"),
        ("attachment; filename*=ISO-8859-1''caf%E9.md", "café.md"),
        ("attachment; filename*0*=UTF-8''long%20; filename*1=name.md", "long name.md"),
        ('inline; FILENAME="../../etc/passwd"', "passwd"),
        ("attachment", "setup.md"),
        ('attachment; filename=""', "setup.md"),
        (None, "setup.md"),
    ],
)
def test_the_file_name_is_the_dispositions_else_the_urls(disposition, name):
    """Quoted names keep their semicolons, encoded names their charset, continued names
    are joined, a path is cut to its last part; without a name the URL's last segment."""
    assert name_from(disposition, PAGE) == name


def test_a_url_without_a_file_name_is_named_after_its_host():
    # A site's root keeps the slash: "docs.example" alone would read as an .example file.
    assert name_from(None, httpx.URL("https://docs.example/")) == "docs.example/"


@pytest.mark.parametrize(
    ("content_type", "data", "expected"),
    [
        ('text/html; charset="ISO-8859-1"', "café".encode("latin-1"), "café".encode()),
        ("text/plain; charset=windows-1252", "“quoted”".encode("cp1252"), "“quoted”".encode()),
        ("application/json; charset=utf-16", '{"a": "é"}'.encode("utf-16"), '{"a": "é"}'.encode()),
        ("text/plain; charset=UTF8", "café".encode(), "café".encode()),
        ("text/plain; x-charset=latin-1", "café".encode(), "café".encode()),
        ("text/plain; charset=no-such-codec", b"caf\xc3\xa9", b"caf\xc3\xa9"),
        ("text/plain; charset=base64", b"Y2Fm", b"Y2Fm"),
        ("text/plain", "café".encode(), "café".encode()),
    ],
)
def test_text_in_another_charset_is_re_encoded_as_utf8(content_type, data, expected):
    """The charset parameter (quoted or not, any alias) decides; a parameter that merely
    ends in `charset` or a charset nobody knows leaves the bytes as they are."""
    assert to_utf8(data, content_type) == expected


def test_binary_types_are_never_re_encoded():
    data = "café".encode("latin-1")
    assert to_utf8(data, "application/pdf; charset=latin-1") == data
