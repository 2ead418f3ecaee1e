"""The child process of `ProcessEncoder` (services/common/embedders/local.py): run as
`python -m services.common.embedders.encoder_process`, it receives an encoder factory on
stdin, builds it, then answers each batch of texts with their vectors on stdout until stdin
closes (the parent is gone or closed it)."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

# Below the server's priority: when a search and a document batch want the same core, the
# search gets it (the batch only finishes a little later). At equal priority a search during
# an ingest on 2 cores took 54 ms (p50) instead of 12; niced, 21.
NICENESS = 10


def serve() -> None:
    os.nice(NICENESS)
    out = os.dup(1)
    os.dup2(2, 1)  # stray prints of libraries go to stderr, not into the pipe
    receive = Connection(os.dup(0), writable=False)
    send = Connection(out, readable=False)
    try:
        factory = receive.recv()
        encoder = factory()
        encoder.encode(["warm up"], query=False)
    except BaseException as err:  # reported to the parent, which fails its start
        send.send(("error", repr(err)))
        return
    send.send(("ready", getattr(encoder, "kind", type(encoder).__name__)))
    while True:
        try:
            texts = receive.recv()
        except (EOFError, OSError):
            return
        try:
            send.send(("ok", encoder.encode(texts, query=False)))
        except Exception as err:
            send.send(("error", repr(err)))


if __name__ == "__main__":
    serve()
