"""Office files (zips) whose headers lie, as an attacker writes them: built with zipfile, then
the fields that a reader trusts rewritten in the bytes, in the member's local header and in
the central directory alike."""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

DECK = Path(__file__).parent.parent / "fixtures" / "formats" / "deck.pptx"
SLIDE = "ppt/slides/slide1.xml"
# Where each field sits in a local file header and in a central directory entry (APPNOTE 4.3.7
# and 4.3.12).
_LOCAL = {"crc": 14, "size": 22}
_CENTRAL = {"crc": 16, "size": 24}


def with_member(data: bytes, member: str, content_bytes: int) -> bytes:
    """The zip `data` with `member` replaced by `content_bytes` zero bytes, deflated at level
    9 (about a thousand to one) and streamed, never held whole here."""
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(data)) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst,
    ):
        for info in src.infolist():
            if info.filename != member:
                dst.writestr(info, src.read(info))
                continue
            block = bytes(1024 * 1024)
            with dst.open(member, "w") as f:
                for start in range(0, content_bytes, len(block)):
                    f.write(block[: content_bytes - start])
    return out.getvalue()


def patched(data: bytes, member: str, **fields: int) -> bytes:
    """`data` with `member`'s `crc` or uncompressed `size` set to the given values in both of
    its headers."""
    out = bytearray(data)
    end = data.rindex(b"PK\x05\x06")
    (entries,) = struct.unpack_from("<H", data, end + 10)
    (pos,) = struct.unpack_from("<L", data, end + 16)
    found = False
    for _ in range(entries):
        name_len, extra_len, comment_len = struct.unpack_from("<3H", data, pos + 28)
        (local,) = struct.unpack_from("<L", data, pos + 42)
        if data[pos + 46 : pos + 46 + name_len].decode() == member:
            for field, value in fields.items():
                struct.pack_into("<L", out, pos + _CENTRAL[field], value)
                struct.pack_into("<L", out, local + _LOCAL[field], value)
            found = True
        pos += 46 + name_len + extra_len + comment_len
    if not found:
        raise LookupError(f"{member} is not in the zip")
    return bytes(out)


def lying_deck(inflated_bytes: int, declared_bytes: int = 3000) -> bytes:
    """A real presentation whose first slide inflates to `inflated_bytes` while both its
    headers declare `declared_bytes`: it passes every check of declared sizes."""
    return patched(
        with_member(DECK.read_bytes(), SLIDE, inflated_bytes), SLIDE, size=declared_bytes
    )


def damaged_deck() -> bytes:
    """A real presentation whose first slide's checksum is wrong, as a bit flipped on a disk
    leaves it: the reader fails on it with an I/O error of its own."""
    return patched(DECK.read_bytes(), SLIDE, crc=0xDEADBEEF)
