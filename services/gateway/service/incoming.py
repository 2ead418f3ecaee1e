"""A file's bytes as they arrive (a multipart file part, a raw request body): counted against
the document size limit as they come, held once, and handed to the object store whole."""

from __future__ import annotations

import asyncio
import tempfile
from types import TracebackType
from typing import BinaryIO

from services.common.domain.content import too_large

# Beyond this a file waits on disk instead of in memory (Starlette spools form files alike):
# the gateway's memory does not grow with the size or the number of uploads in flight.
MEMORY_BYTES = 1024 * 1024
_WHITESPACE = b" \t\n\r\x0b\x0c"


class Incoming:
    """An upload's bytes, written as they arrive. A write that would pass `max_bytes` raises
    TooLarge (field `field`) before anything more is kept: an over-size body is refused at
    the byte that crosses the limit, not after it has been read whole. Close it (or use it
    as a context manager) when done; nothing of it outlives that."""

    def __init__(self, max_bytes: int, *, field: str = "content") -> None:
        self.max_bytes = max_bytes
        self.field = field
        self.size = 0
        self.blank = True  # nothing but whitespace so far
        self._file = tempfile.SpooledTemporaryFile(max_size=MEMORY_BYTES)  # noqa: SIM115

    async def write(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self.size + len(chunk) > self.max_bytes:
            raise too_large(self.max_bytes, field=self.field)
        if self.blank and chunk.strip(_WHITESPACE):
            self.blank = False
        if self.size + len(chunk) > MEMORY_BYTES:
            await asyncio.to_thread(self._file.write, chunk)  # on disk: keep the loop free
        else:
            self._file.write(chunk)
        self.size += len(chunk)

    def reader(self) -> BinaryIO:
        """The bytes from the start (the object store reads them in a worker thread)."""
        self._file.seek(0)
        return self._file  # type: ignore[return-value]

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Incoming:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
