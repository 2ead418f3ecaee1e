"""The child process of `ProcessEncoder` (services/common/embedders/local.py): run as
`python -m services.common.embedders.encoder_process`, it receives an encoder factory on
stdin, builds it, then answers each batch of texts with their vectors on stdout until stdin
closes (the parent is gone or closed it)."""

from __future__ import annotations

import contextlib
import os
from multiprocessing.connection import Connection

# Below everything else on the machine: a child computes only on a core that no other
# process wants (Linux's SCHED_IDLE), so a search never waits for a document batch, which
# only finishes a little later. At equal priority a search during an ingest on 2 cores took
# 54 ms (p50) instead of 12; niced by 10, 21; SCHED_IDLE on top, 11.0-14.3 against
# 21.2-23.3 niced alone, with the ingest under that search loop as long (7.6-8.0 s against
# 8.0-8.7) and an ingest alone no slower (docs/benchmarks.md). The niceness stays for
# systems without SCHED_IDLE.
NICENESS = 10


def _yield_to_everything() -> None:
    os.nice(NICENESS)
    if hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def serve() -> None:
    _yield_to_everything()
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
