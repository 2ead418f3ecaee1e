"""The data directory's format: which version of kbmesh's on-disk layout it holds, recorded in
`<data_dir>/FORMAT` and checked before anything opens the directory.

A kbmesh opens a data dir of its own format or an older one (migrating it forward, one step
at a time, before anything else reads it) and refuses a newer one with a message that says
so: it never rewrites data it does not understand. Directories written before the format was
recorded (NATS store, Edge shards, model exports, no FORMAT file) are format 0.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path

from services.common.ops.files import write_private

FORMAT_FILE = "FORMAT"
# 1: the layout of format 0, with its version recorded.
CURRENT_FORMAT = 1


class DataDirError(Exception):
    """The data dir cannot be opened by this kbmesh; the message says why and what to do."""


def _record_version(path: Path) -> None:
    """0 → 1: nothing moves; the version is written below."""


# MIGRATIONS[n] turns format n into n + 1.
MIGRATIONS: dict[int, Callable[[Path], None]] = {0: _record_version}


def read_format(path: Path) -> int | None:
    """The format of the data dir at `path`; None when it holds nothing yet."""
    marker = path / FORMAT_FILE
    if marker.exists():
        try:
            version = json.loads(marker.read_text())["format"]
        except (ValueError, KeyError, TypeError) as err:
            raise DataDirError(
                f"{marker} is unreadable ({err}); restore it from a backup, or move the data "
                "dir aside"
            ) from err
        if not isinstance(version, int) or version < 0:
            raise DataDirError(f"{marker} names no format version: {version!r}")
        return version
    if path.is_dir() and any(path.iterdir()):
        return 0
    return None


def open_data_dir(path: Path) -> int:
    """Make `path` a data dir of the current format: create it, migrate an older one, or
    refuse a newer one (DataDirError). Returns the format it had (None read as current).
    Processes opening one data dir at once take turns: one creates or migrates it, the others
    then find it current."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    # The lock is on the directory itself, so opening a data dir adds no file to it.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return _open_locked(path)
    finally:
        os.close(fd)  # closing releases the lock


def _open_locked(path: Path) -> int:
    found = read_format(path)
    if found is None:
        _write_format(path, CURRENT_FORMAT)
        return CURRENT_FORMAT
    if found > CURRENT_FORMAT:
        raise DataDirError(
            f"the data dir {path} has format {found}, written by a newer kbmesh; this one reads "
            f"formats up to {CURRENT_FORMAT}. Upgrade kbmesh, or point KBMESH_DATA_DIR elsewhere "
            "(nothing in it was changed)"
        )
    for version in range(found, CURRENT_FORMAT):
        MIGRATIONS[version](path)
        _write_format(path, version + 1)
    return found


def _write_format(path: Path, version: int) -> None:
    # Written whole or not at all: a crash mid-write must not leave an unreadable marker.
    write_private(path / FORMAT_FILE, json.dumps({"format": version}))
