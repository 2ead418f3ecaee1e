"""A git source on the default stack: first sync, no-change re-sync, commit to searchable.

    .venv/bin/python -m benchmarks.sources_git [--files 500] [--commits 5]

A repository of `--files` markdown files (slices of the standard library's pydoc pages,
about 1.5 kB each) is served by `git daemon` on loopback; one `kbmesh up` keeps its
default KB in sync with it. Reports, for the first sync and for a re-sync with nothing
new: the run's duration, files per second, bytes read and chunks embedded (the
`kbmesh_chunks_embedded_total` delta), and for the first sync the time until every file is
searchable; then, for `--commits` one-file commits, the time from the `source.sync` (what a
verified webhook publishes) to the changed file's new text being found by search.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import kbmesh_up_at, stdlib_documents
from services.common.bus.auth import recorded_credentials
from services.common.bus.nats_server import free_port, wait_for_port
from services.common.bus.registry import Registries, SourceRegistry
from services.common.domain.sources import Source, SourceSecrets, SourceState
from services.common.messages.events import SourceSync
from services.common.messages.names import Subject

ORG = "local"
SOURCE_ID = "bench-git"
SLICE = 1500


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)
    return done.stdout.decode()


def make_repository(repo: Path, files: int) -> int:
    """`files` markdown files of real text; their total bytes."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "bench@example.com")
    git(repo, "config", "user.name", "bench")
    text = "\n".join(body for _, body in stdlib_documents(70))
    total = 0
    for i in range(files):
        start = (i * SLICE) % max(len(text) - SLICE, 1)
        body = f"# Page {i}\n\n{text[start : start + SLICE]}\n"
        path = repo / "docs" / f"section-{i // 50:02}" / f"page-{i:04}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
        total += len(body.encode())
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "the pages")
    return total


@contextlib.contextmanager
def git_daemon(base: Path) -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen(
        [
            "git",
            "daemon",
            "--reuseaddr",
            "--export-all",
            f"--base-path={base}",
            "--listen=127.0.0.1",
            f"--port={port}",
            str(base),
        ]
    )
    try:
        wait_for_port("127.0.0.1", port)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def chunks_embedded(client: httpx.AsyncClient) -> float:
    r = await client.get("/metrics")
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == "kbmesh_chunks_embedded_total":
                return float(sample.value)
    return 0.0


async def sync(nc: nats.NATS, reg: Registries) -> SourceState:
    """Publish a `source.sync` and wait for its run to end; the state then."""
    key = SourceRegistry.state_key(ORG, SOURCE_ID)
    before = await reg.sources.state(ORG, SOURCE_ID)
    runs = len(before.runs) if before else 0
    event = SourceSync(org_id=ORG, source_id=SOURCE_ID, trigger="hook")
    await nc.jetstream().publish(
        str(Subject.SOURCE_SYNC),
        event.model_dump_json().encode(),
        headers={"Nats-Msg-Id": event.event_id},
    )
    ok, state = await reg.sources.states.wait_for(
        key, lambda s: s is not None and len(s.runs) > runs, 1800
    )
    assert ok and state is not None
    return state


async def wait_searchable(client: httpx.AsyncClient, files: int) -> None:
    while True:
        stats = (await client.get("/v1/kbs/default/stats")).json()
        if stats["progress"]["indexed"] >= files and not stats["progress"]["pending"]:
            return
        await asyncio.sleep(0.2)


async def run(files: int, commits: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp) / "git"
        repo = base_dir / "pages"
        total_bytes = make_repository(repo, files)
        data = Path(tmp) / "data"
        with (
            git_daemon(base_dir) as port,
            kbmesh_up_at(data, KBMESH_EGRESS__ALLOW_PRIVATE="true") as base,
        ):
            creds = recorded_credentials(data, "operator")
            assert creds is not None
            url = (data / "nats.url").read_text().strip()
            nc = await nats.connect(
                url, user=creds.user, password=creds.password, inbox_prefix=b"_INBOX.operator"
            )
            reg = await Registries.open(nc.jetstream())
            async with httpx.AsyncClient(base_url=base, timeout=600) as client:
                await client.get("/v1/kbs/default/stats")  # the default KB, created on use
                await reg.source_secrets.put(
                    f"{ORG}.{SOURCE_ID}", SourceSecrets(webhook_secret="bench")
                )
                await reg.sources.put(
                    Source(
                        kind="git",
                        kb="default",
                        url=f"git://127.0.0.1:{port}/pages",
                        org_id=ORG,
                        source_id=SOURCE_ID,
                        kb_id="default",
                        enabled=False,  # runs when asked only
                    )
                )
                rows = []
                for label in ("first sync", "no-change re-sync"):
                    chunks = await chunks_embedded(client)
                    started = time.perf_counter()
                    state = await sync(nc, reg)
                    run_ = state.runs[-1]
                    assert run_.status == "succeeded", run_.error
                    seconds = run_.duration_seconds or 0.0
                    searchable = None
                    if label == "first sync":
                        await wait_searchable(client, files)
                        searchable = time.perf_counter() - started
                    rows.append(
                        (label, run_, seconds, searchable, await chunks_embedded(client) - chunks)
                    )

                latencies = []
                for i in range(commits):
                    token = f"zqx{i}marker"
                    page = repo / "docs" / "section-00" / "page-0000.md"
                    page.write_text(page.read_text() + f"\nchanged {token}\n")
                    git(repo, "commit", "-q", "-am", f"change {i}")
                    started = time.perf_counter()
                    await sync(nc, reg)
                    while True:
                        r = await client.post(
                            "/v1/search", json={"query": token, "mode": "keyword", "top_k": 1}
                        )
                        hits = r.json()["hits"]
                        if hits and token in hits[0]["content"]:
                            break
                        await asyncio.sleep(0.05)
                    latencies.append(time.perf_counter() - started)
            await reg.close()
            await nc.close()

    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(f"repository {files} files, {total_bytes / 1e6:.2f} MB, git daemon on loopback")
    print(
        "| run | files sent | unchanged | run s | repository files/s | bytes read | "
        "chunks embedded | all searchable s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, run_, seconds, searchable, chunks in rows:
        sent = run_.added + run_.changed
        rate = files / seconds if seconds else 0.0
        shown = f"{searchable:.1f}" if searchable is not None else "—"
        print(
            f"| {label} | {sent} | {run_.unchanged} | {seconds:.2f} | {rate:.0f} | "
            f"{run_.bytes_read} | {chunks:.0f} | {shown} |"
        )
    print(
        f"commit → searchable via source.sync, {commits} one-file commits: median "
        f"{statistics.median(latencies):.2f} s, max {max(latencies):.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=500)
    parser.add_argument("--commits", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(run(args.files, args.commits))


if __name__ == "__main__":
    main()
