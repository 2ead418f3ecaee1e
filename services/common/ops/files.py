"""Files kbmesh writes for its owner: backup archives, credentials, the nats-server
configuration, the data dir's format marker.

Each is written whole or not at all, readable by its owner only (0600), and never through a
link. The new content goes to a temporary file that `tempfile.mkstemp` creates in the
destination's folder (a fresh random name, O_CREAT|O_EXCL, mode 0600: a file or link planted
at any name there is never opened, let alone followed), then takes the destination's name with
one rename, which replaces a link at that name rather than writing into its target.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[BinaryIO]:
    """A new private file that takes `path`'s place when the block ends without an error;
    on an error it is removed and `path` is left as it was."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())  # complete on disk before it is renamed into place
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        raise


def write_private(path: Path, content: str | bytes) -> None:
    """`content` at `path`, whole, owner-only; the folder is made (0700) when missing."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with replacing(path) as out:
        out.write(content.encode() if isinstance(content, str) else content)
