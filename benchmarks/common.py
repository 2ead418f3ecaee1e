"""Shared benchmark helpers: real text from this machine, and a `kbmesh up` subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pydoc
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from services.common.bus.nats_server import free_port

ROOT = Path(__file__).resolve().parents[1]
STDLIB_MODULES = [
    "json",
    "csv",
    "argparse",
    "logging",
    "asyncio.tasks",
    "pathlib",
    "datetime",
    "re",
    "collections",
    "itertools",
    "functools",
    "subprocess",
    "socket",
    "ssl",
    "sqlite3",
    "unittest",
    "typing",
    "dataclasses",
    "http.client",
    "urllib.parse",
    "email.message",
    "shutil",
    "tarfile",
    "zipfile",
    "threading",
    "multiprocessing.pool",
    "decimal",
    "fractions",
    "statistics",
    "random",
    "hashlib",
    "hmac",
    "secrets",
    "uuid",
    "string",
    "textwrap",
    "difflib",
    "heapq",
    "bisect",
    "enum",
    "contextlib",
    "inspect",
    "ast",
    "tokenize",
    "pickle",
    "copy",
    "pprint",
    "struct",
    "io",
    "os.path",
]


def stdlib_documents(count: int) -> list[tuple[str, str]]:
    """Real documentation text available offline: pydoc pages of stdlib modules."""
    docs = []
    for name in STDLIB_MODULES[:count]:
        text = pydoc.render_doc(name, renderer=pydoc.plaintext)
        docs.append((f"{name}.txt", text[:20000]))
    return docs


def bench_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KBMESH_")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        TOKENIZERS_PARALLELISM="false",
        # Benchmarks upload with `wait=true` (`kbmesh_ingest`): a wait outlasts any ingest.
        KBMESH_WAIT_TIMEOUT_SECONDS="900",
        # One ONNX export of the bundled model for every benchmark run (built on first use).
        KBMESH_MODEL_CACHE_DIR=os.environ.get(
            "KBMESH_MODEL_CACHE_DIR", str(ROOT / "benchmarks" / "data" / "models")
        ),
    )
    env.update(extra)
    return env


@contextlib.contextmanager
def kbmesh_up(**env: str) -> Iterator[str]:
    """A fresh `kbmesh up` on a temporary data dir; yields its base URL."""
    with tempfile.TemporaryDirectory() as data, kbmesh_up_at(Path(data), **env) as base:
        yield base


@contextlib.contextmanager
def kbmesh_up_at(
    data_dir: Path | None,
    constants: dict[str, object] | None = None,
    root: Path = ROOT,
    **env: str,
) -> Iterator[str]:
    """`kbmesh up` on `data_dir` (a temporary one when None), with the module `constants`
    given ({"services.search.service.RRF_K": 20}: see benchmarks/with_constants.py) set in
    its process, running the code of the checkout at `root`; yields its base URL."""
    with contextlib.ExitStack() as stack:
        if data_dir is None:
            data = stack.enter_context(tempfile.TemporaryDirectory())
        else:
            data_dir.mkdir(parents=True, exist_ok=True)
            data = str(data_dir)
        port = free_port()
        log = open(Path(data) / "kbmesh.log", "wb")  # noqa: SIM115
        command = ["-m", "services.cli"]
        if constants:
            command = ["-m", "benchmarks.with_constants", json.dumps(constants)]
        proc = subprocess.Popen(
            [sys.executable, *command, "up", "--data-dir", data, "--port", str(port)],
            cwd=root,
            env=bench_env(**({"PYTHONPATH": str(root)} if root != ROOT else {}), **env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None:
                    raise RuntimeError((Path(data) / "kbmesh.log").read_text()[-3000:])
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError("kbmesh up did not become ready")
                time.sleep(0.2)
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            log.close()


def kbmesh_cpu(data_dir: Path) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the `kbmesh up` serving `data_dir` and the
    processes it started, by role: the server itself, its document encoder children, its
    nats-server. Compare two readings to see where a piece of work spent the CPU."""
    processes: dict[int, tuple[int, str, float]] = {}  # pid -> (parent, command line, cpu)
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # ended meanwhile
            continue
        # The fields after the command name, which may itself hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        processes[int(entry.name)] = (
            int(fields[1]),
            command,
            (int(fields[11]) + int(fields[12])) / tick,
        )
    marker = f"--data-dir {data_dir}"
    roots = [pid for pid, (_, command, _) in processes.items() if marker in command]
    usage = {"server": 0.0, "encoders": 0.0, "nats-server": 0.0}
    below = set(roots)
    while True:
        more = {pid for pid, (parent, _, _) in processes.items() if parent in below} - below
        if not more:
            break
        below |= more
    for pid in below:
        _, command, cpu = processes[pid]
        role = (
            "encoders"
            if "multiprocessing" in command  # the document encoders' spawned children
            else "nats-server"
            if "nats-server" in command
            else "server"
        )
        usage[role] += cpu
    return usage


def pct(values: list[float], q: float) -> float:
    """The q-quantile of `values` (seconds), in milliseconds."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000


# Uploads in flight at once: each holds its connection until its document is indexed.
UPLOADS_IN_FLIGHT = 64


async def kbmesh_ingest(client: httpx.AsyncClient, kb_id: str, corpus: list[dict]) -> tuple:
    """Upload `corpus` (BEIR documents) into the KB through REST with `wait=true`, each
    upload answered once its document is indexed or failed (the server's own notification):
    (seconds until the last answer, document id → corpus id, the KB's stats then). Polling
    the stats instead cost the server CPU the ingest it measured would have used: a stats
    call reads every record of the KB and of its org (docs/benchmarks.md, "Pipeline")."""
    gate = asyncio.Semaphore(UPLOADS_IN_FLIGHT)
    ids: dict[str, str] = {}

    async def one(doc: dict) -> None:
        async with gate:
            r = await client.post(
                f"/v1/kbs/{kb_id}/documents",
                params={"wait": "true"},
                json={"name": doc["_id"], "content": doc["text"]},
            )
            r.raise_for_status()
            body = r.json()
            if body["status"] not in ("complete", "failed"):
                raise RuntimeError(f"{doc['_id']}: not indexed within the wait: {body}")
            ids[body["document_id"]] = doc["_id"]

    started = time.perf_counter()
    await asyncio.gather(*(one(d) for d in corpus))
    seconds = time.perf_counter() - started
    return seconds, ids, (await client.get(f"/v1/kbs/{kb_id}/stats")).json()
