"""A source's run killed halfway (kill -9 of `kbmesh up`) is finished by the next run after
the restart: every file of the repository becomes exactly one document, none twice, none
lost."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import nats

from services.common.bus.registry import Registries, SourceRegistry
from services.common.domain.models import DocStatus
from services.common.domain.sources import Source, SourceSecrets
from services.common.messages.events import SourceRunEvent, SourceSync
from services.common.messages.names import Subject
from tests.support.bus import bus_url
from tests.support.gitserver import git_daemon
from tests.support.procs import Proc, free_port, kbmesh_env, wait_ready, wait_until

ORG = "local"
FILES = 400
SOURCE_ID = "crash-test"


@asynccontextmanager
async def operator(data: Path) -> AsyncIterator[tuple[nats.NATS, Registries]]:
    """The bus of the `kbmesh up` on `data`, as its operator."""
    url = (data / "nats.url").read_text().strip()
    nc = await nats.connect(bus_url(url, data), inbox_prefix=b"_INBOX.operator")
    try:
        yield nc, await Registries.open(nc.jetstream())
    finally:
        await nc.close()


async def start_sync(data: Path, repo_url: str) -> SourceRunEvent:
    """Add the source and ask for its run; the run's first progress report (it is under
    way, some documents sent, most not)."""
    async with operator(data) as (nc, reg):
        progress: asyncio.Future[SourceRunEvent] = asyncio.get_running_loop().create_future()

        async def on_run(msg: nats.aio.msg.Msg) -> None:
            event = SourceRunEvent.model_validate_json(msg.data)
            if event.run.status == "running" and event.run.added and not progress.done():
                progress.set_result(event)

        await nc.subscribe(str(Subject.SOURCE_RUN), cb=on_run)
        await reg.source_secrets.put(f"{ORG}.{SOURCE_ID}", SourceSecrets(webhook_secret="x"))
        await reg.sources.put(
            Source(
                kind="git",
                kb="default",
                url=repo_url,
                org_id=ORG,
                source_id=SOURCE_ID,
                kb_id="default",
                enabled=False,  # runs when asked only
            )
        )
        event = SourceSync(org_id=ORG, source_id=SOURCE_ID)
        await nc.jetstream().publish(
            str(Subject.SOURCE_SYNC),
            event.model_dump_json().encode(),
            headers={"Nats-Msg-Id": event.event_id},
        )
        return await asyncio.wait_for(progress, 120)


async def finished_state(data: Path) -> tuple[str | None, str | None]:
    """(status of the last finished run, cursor), waiting up to 3 minutes for a run to end."""
    async with operator(data) as (_, reg):
        ok, state = await reg.sources.states.wait_for(
            SourceRegistry.state_key(ORG, SOURCE_ID),
            lambda s: s is not None and s.last_run is not None,
            180,
        )
        assert ok and state is not None and state.last_run is not None, state
        return state.last_run.status, state.cursor


async def source_documents(data: Path) -> list:  # type: ignore[type-arg]
    async with operator(data) as (_, reg):
        return [r for r in await reg.documents.of_org(ORG) if r.source_id == SOURCE_ID]


def test_a_run_killed_halfway_is_finished_by_the_next_with_nothing_lost_or_doubled(tmp_path):
    """kill -9 of `kbmesh up` while its sources service publishes a 400-file repository:
    the state keeps no cursor (the run did not end); after a restart on the same data
    directory the next run (taking over the dead replica's lease once it expires) ends
    successfully, and the KB holds each file once — one document per path, every one at
    its first revision (nothing sent twice was applied twice), none missing."""
    with git_daemon(tmp_path / "git") as daemon:
        repo = daemon.repo("handbook")
        for i in range(FILES):
            repo.write(f"pages/page-{i:04}.md", f"# Page {i}\n\nhandbook page {i} keyword k{i}x\n")
        head = repo.commit("the handbook")
        data = tmp_path / "data"
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        args = ["up", "--data-dir", str(data), "--port", str(port)]
        env = kbmesh_env(KBMESH_EGRESS__ALLOW_PRIVATE="true")

        first = Proc(args, tmp_path / "first.log", env)
        try:
            wait_ready(base, first)
            progress = asyncio.run(start_sync(data, repo.url))
        finally:
            first.kill9()
        assert progress.run.added < FILES, "the run ended before the kill; nothing was tested"

        second = Proc(args, tmp_path / "second.log", env)
        try:
            wait_ready(base, second)
            status, cursor = asyncio.run(finished_state(data))
            assert status == "succeeded" and cursor is not None and cursor.startswith(head)

            def all_ready() -> list:  # type: ignore[type-arg]
                docs = asyncio.run(source_documents(data))
                ready = [d for d in docs if d.status == DocStatus.ready]
                return docs if len(ready) >= FILES else []

            docs = wait_until(all_ready, 300, "every file's document ready", interval=1.0)
            assert sorted(d.uri for d in docs) == [f"pages/page-{i:04}.md" for i in range(FILES)]
            assert {d.revision for d in docs} == {1}
            with httpx.Client(base_url=base, timeout=60) as client:
                hits = wait_until(
                    lambda: client.post(
                        "/v1/search", json={"query": f"k{FILES - 1}x", "mode": "keyword"}
                    ).json()["hits"],
                    300,
                    "the last file searchable",
                    interval=1.0,
                )
                assert hits[0]["uri"] == f"pages/page-{FILES - 1:04}.md"
        finally:
            second.stop()
