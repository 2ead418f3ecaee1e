"""Ingest by server-side path: a file under `KBMESH_UPLOAD_ROOT`, read safely, before the bytes
become an ordinary upload. Only regular files under the root once every symlink is resolved.
Ingest by URL is `services.common.outbound.fetch.fetch_url`, the egress rule every outbound
fetch shares.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

from services.common.domain.errors import Forbidden, InvalidInput, NotFound, TooLarge
from services.common.outbound.fetch import Fetched
from services.common.settings import Settings


def _mb(limit: int) -> str:
    return f"{limit / (1024 * 1024):g} MB"


# ---- path -----------------------------------------------------------------------------------


async def read_path(path: str, settings: Settings) -> Fetched:
    return await asyncio.to_thread(_read_path, path, settings)


def _read_path(path: str, settings: Settings) -> Fetched:
    if settings.upload_root is None:
        raise Forbidden(
            "ingest by path is disabled on this server (set KBMESH_UPLOAD_ROOT)", field="path"
        )
    if not path.strip() or "\x00" in path:
        raise InvalidInput("path must be a file path under the upload root", field="path")
    try:
        root = settings.upload_root.resolve(strict=True)
    except OSError as err:
        raise Forbidden(
            "the upload root (KBMESH_UPLOAD_ROOT) does not exist", field="path"
        ) from err
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = root / candidate
    # resolve() follows every symlink, so containment is checked on the real target; a
    # missing file is reported only inside the root, never outside it.
    resolved = candidate.resolve()
    if not resolved.is_relative_to(root):
        raise Forbidden(f"path {path!r} is outside the upload root", field="path")
    limit = settings.max_content_bytes
    try:
        # O_NOFOLLOW: the checked path cannot be swapped for a symlink before it is opened.
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError as err:
        raise NotFound(f"no file at {path!r} under the upload root", field="path") from err
    except OSError as err:
        raise Forbidden(f"cannot open {path!r}: {err.strerror}", field="path") from err
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidInput(f"{path!r} is not a regular file", field="path")
        if info.st_size > limit:
            raise TooLarge(
                f"{path!r} has {info.st_size} bytes, over the {_mb(limit)} limit "
                "(KBMESH_MAX_CONTENT_BYTES)",
                field="path",
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise TooLarge(f"{path!r} is over the {_mb(limit)} limit", field="path")
    return Fetched(data=data, mime_type=None, name=resolved.name, uri=path)
