"""Files through REST as JSON with base64 content versus as multipart forms: bytes sent, the
gateway's peak memory, and the time until indexed.

    python -m benchmarks.upload_bytes [--files 200] [--in-flight 8]

For each way of sending, a fresh stack with the services split across processes (one
nats-server; `kbmesh serve ingest`, `serve embed search`, `serve gateway`), so that the
gateway's memory is its own: 200 small text files (pieces of pydoc pages of the standard
library, 2-4 KB) with `wait=true`, 8 in flight as `kbmesh ingest` sends them, then a ~10 MB
PDF (twelve of those pages as text, and photographs: incompressible images) with
`wait=true`. JSON sends every file base64-encoded, as clients had to before forms
were taken; multipart sends the bytes. The gateway's peak RSS is read per phase from
/proc (VmHWM, reset before the phase); "bytes sent" are the request bodies.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime
import io
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.common import ROOT, STDLIB_MODULES, bench_env, stdlib_documents
from services.common.bus.nats_server import NatsServer, free_port

KBMESH = [sys.executable, "-m", "services.cli"]
PDF_BYTES = 10_000_000  # under the 10 MiB default limit
PROCESSES = {"ingest": ["ingest"], "embed": ["embed", "search"], "gateway": ["gateway"]}


def report_pdf(target: int = PDF_BYTES) -> bytes:
    """A PDF of about `target` bytes: twelve pydoc pages of text, then photographs (noise
    JPEGs, which no compression shrinks) until the size is reached."""
    from fpdf import FPDF
    from PIL import Image

    rng = random.Random(7)
    pdf = FPDF()
    pdf.set_font("Helvetica", size=10)
    for _name, text in stdlib_documents(12):
        pdf.add_page()
        pdf.multi_cell(0, 5, text.encode("latin-1", "replace").decode("latin-1"))
    size = 160_000  # the text pages, compressed
    while size < target - 600_000:
        photo = Image.frombytes("RGB", (1000, 1000), rng.randbytes(3_000_000))
        jpeg = io.BytesIO()
        photo.save(jpeg, "JPEG", quality=90)
        pdf.add_page()
        pdf.image(io.BytesIO(jpeg.getvalue()), w=180)
        size += len(jpeg.getvalue())
    return bytes(pdf.output())


def small_files(count: int) -> list[tuple[str, bytes]]:
    """`count` text files of 2-4 KB cut from pydoc pages (real prose and signatures)."""
    files: list[tuple[str, bytes]] = []
    for name, text in stdlib_documents(len(STDLIB_MODULES)):
        for start in range(0, len(text) - 2000, 3000):
            if len(files) == count:
                return files
            files.append((f"{name}-{start // 3000}.md", text[start : start + 3000].encode()))
    return files


def memory_mb(pid: int, field: str) -> float:
    """A process's `VmRSS` (resident now) or `VmHWM` (peak resident), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def reset_peak(pid: int) -> None:
    # Linux: "5" resets the peak resident set size to the current one.
    Path(f"/proc/{pid}/clear_refs").write_text("5")


@dataclass
class Stack:
    base: str
    gateway_pid: int


@contextlib.contextmanager
def split_stack() -> Iterator[Stack]:
    """nats-server plus three `kbmesh serve` processes on a temporary data dir."""
    with tempfile.TemporaryDirectory() as data, contextlib.ExitStack() as stack:
        nats = NatsServer(Path(data) / "nats").start()
        stack.callback(nats.stop)
        port = free_port()
        env = bench_env(KBMESH_NATS_URL=nats.url, KBMESH_DATA_DIR=data, KBMESH_PORT=str(port))
        procs = {}
        for name, services in PROCESSES.items():
            log = stack.enter_context((Path(data) / f"{name}.log").open("wb"))
            procs[name] = subprocess.Popen(
                [*KBMESH, "serve", *services], cwd=ROOT, env=env, stdout=log, stderr=log
            )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                dead = [n for n, p in procs.items() if p.poll() is not None]
                if dead:
                    raise RuntimeError((Path(data) / f"{dead[0]}.log").read_text()[-3000:])
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError("the split stack did not become ready")
                time.sleep(0.2)
            yield Stack(base, procs["gateway"].pid)
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(60)


def request(how: str, name: str, data: bytes) -> dict[str, object]:
    """The keyword arguments of one upload, the way `how` sends a file."""
    if how == "json":
        body = {
            "name": name,
            "content": base64.b64encode(data).decode("ascii"),
            "content_encoding": "base64",
        }
        return {"json": body}
    return {"files": {"file": (name, data)}}


@dataclass
class Phase:
    how: str
    what: str
    sent_bytes: int
    seconds: float
    peak_mb: float
    idle_mb: float


async def measure(
    how: str, pdf: bytes, files: list[tuple[str, bytes]], in_flight: int
) -> list[Phase]:
    phases = []
    with split_stack() as stack:
        sent = 0

        async def count(req: httpx.Request) -> None:
            nonlocal sent
            sent += int(req.headers.get("content-length", 0))

        async with httpx.AsyncClient(
            base_url=stack.base, timeout=900, event_hooks={"request": [count]}
        ) as client:
            kb = (await client.post("/v1/kbs", json={"name": "bench"})).json()["kb_id"]
            path = f"/v1/kbs/{kb}/documents"
            # The model loads on the first document: not part of any phase.
            r = await client.post(
                path, params={"wait": "true"}, json={"name": "warm", "content": "warm up"}
            )
            r.raise_for_status()

            async def upload(name: str, data: bytes) -> None:
                r = await client.post(path, params={"wait": "true"}, **request(how, name, data))
                r.raise_for_status()
                if r.json()["status"] != "complete":
                    raise RuntimeError(f"{name}: {r.json()}")

            gate = asyncio.Semaphore(in_flight)

            async def gated(name: str, data: bytes) -> None:
                async with gate:
                    await upload(name, data)

            async def the_pdf() -> None:
                await upload("report.pdf", pdf)

            async def the_files() -> None:
                await asyncio.gather(*(gated(name, data) for name, data in files))

            # The small files first: memory the PDF's phase takes may stay with the process.
            for what, work in ((f"{len(files)} small files", the_files), ("10 MB PDF", the_pdf)):
                idle = memory_mb(stack.gateway_pid, "VmRSS")
                reset_peak(stack.gateway_pid)
                sent = 0
                started = time.perf_counter()
                await work()
                seconds = time.perf_counter() - started
                peak = memory_mb(stack.gateway_pid, "VmHWM")
                phases.append(Phase(how, what, sent, seconds, peak, idle))
                print(
                    f"{how:9} {what:16} sent {sent / 1e6:7.2f} MB  {seconds:6.1f} s  "
                    f"gateway RSS {idle:.0f} MB idle, {peak:.0f} MB peak",
                    flush=True,
                )
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=200, help="small files (default 200)")
    parser.add_argument("--in-flight", type=int, default=8, help="uploads at once (default 8)")
    args = parser.parse_args()
    pdf = report_pdf()
    files = small_files(args.files)
    print(
        f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  pdf {len(pdf)} bytes  "
        f"{len(files)} files, {sum(len(d) for _, d in files)} bytes",
        flush=True,
    )
    results = []
    for how in ("json", "multipart"):
        results += asyncio.run(measure(how, pdf, files, args.in_flight))
    print("| upload | sent as | bytes sent | time to indexed | gateway peak RSS (idle) |")
    print("| --- | --- | --- | --- | --- |")
    for p in results:
        print(
            f"| {p.what} | {'JSON, base64' if p.how == 'json' else 'multipart'} | "
            f"{p.sent_bytes / 1e6:.2f} MB | {p.seconds:.1f} s | {p.peak_mb:.0f} MB "
            f"({p.idle_mb:.0f} MB) |"
        )


if __name__ == "__main__":
    main()
