"""Git sources against a real `git daemon` on loopback and the whole stack: a source added
feeds its KB, commits (a change, a rename, a deletion) reach search after the next run, a
run that finds nothing changed embeds nothing, and two replicas never run one source at
once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cli.runtime import source_fetchers
from services.common.bus.registry import SourceRegistry
from services.common.domain.sources import Source, SourceSecrets, SourceState, document_id_for
from services.common.messages.events import SourceSync
from services.common.messages.names import Subject
from services.sources.service import SourcesService
from tests.conftest import running_stack
from tests.support.domain import LONG_DOCS, LONG_QUERIES, create_kb, settled, uid
from tests.support.gitserver import GitDaemon, Repo, git_daemon

ORG = "local"
RUN_SECONDS = 120.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Any:
    with git_daemon(tmp_path_factory.mktemp("git")) as d:
        yield d


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    # Loopback is a private address: the egress rule refuses it unless allowed.
    async with running_stack(
        tmp_path_factory.mktemp("sources"), embedders=embedders, egress={"allow_private": True}
    ) as s:
        yield s


async def add_source(rt: Any, kb: dict[str, Any], repo: Repo, **fields: Any) -> Source:
    source = Source(
        kind="git",
        kb=kb["name"],
        url=repo.url,
        org_id=ORG,
        source_id=f"src-{uid()}",
        kb_id=kb["kb_id"],
        schedule="1h",
        **fields,
    )
    await rt.registries.source_secrets.put(
        rt.registries.source_secrets.key(ORG, source.source_id),
        SourceSecrets(webhook_secret="not-used-here"),
    )
    await rt.registries.sources.put(source)
    return source


async def sync(rt: Any, source: Source) -> SourceState:
    """Ask for a run as "Sync now" does (`source.sync` on the bus) and wait for it to end."""
    key = SourceRegistry.state_key(ORG, source.source_id)
    before = await rt.registries.sources.state(ORG, source.source_id)
    runs = len(before.runs) if before else 0
    await rt.bus.publish(Subject.SOURCE_SYNC, SourceSync(org_id=ORG, source_id=source.source_id))
    ok, state = await rt.registries.sources.states.wait_for(
        key,
        lambda s: s is not None and len(s.runs) > runs and s.requested is None,
        RUN_SECONDS,
    )
    assert ok and state is not None, state
    await settled(rt)
    return state


async def search(client: Any, kb: dict[str, Any], query: str) -> list[dict[str, Any]]:
    r = await client.post("/v1/search", json={"query": query, "kb_ids": [kb["kb_id"]]})
    assert r.status_code == 200, r.text
    hits: list[dict[str, Any]] = r.json()["hits"]
    return hits


async def metric(client: Any, name: str) -> float:
    r = await client.get("/metrics")
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


async def document_events(rt: Any) -> dict[str, int]:
    """How many `doc.uploaded` and `doc.deleted` events the stream holds."""
    info = await rt.bus.js.stream_info("KBMESH", subjects_filter="doc.*")
    subjects = info.state.subjects or {}
    return {s: n for s, n in subjects.items() if s in ("doc.uploaded", "doc.deleted")}


TEA = (
    "# Brewing green tea\n\n"
    "Green tea is steeped at seventy to eighty degrees Celsius for two or three minutes. "
    "Boiling water scorches the leaves and draws out bitter catechins; a second infusion of "
    "the same leaves is often sweeter than the first. Matcha is whisked, not steeped."
)


async def test_a_git_source_keeps_its_kb_in_sync_with_commits(stack, daemon: GitDaemon):
    """Add a git source → search answers from its files (only the included ones; a symlink
    is no document); commit a change, a rename and a deletion → after the next run search
    shows the new text, finds the moved file under its new path and no longer the deleted
    one; each document keeps its source, uri and commit, written by the source. A run with
    no new commit sends nothing and embeds nothing."""
    rt, client = stack
    kb = await create_kb(client)
    repo = daemon.repo(f"docs-{uid()}")
    for name, text in LONG_DOCS.items():
        repo.write(f"docs/{name}", text)
    repo.write("src/skipped.md", "# outside the included paths\nzebra quagga okapi\n")
    (repo.path / "docs" / "passwd.md").symlink_to("/etc/passwd")
    first = repo.commit("three documents")
    source = await add_source(rt, kb, repo, include=["docs/**"])

    state = await sync(rt, source)
    run = state.runs[-1]
    assert run.status == "succeeded", run.error
    assert (run.added, run.changed, run.deleted, run.failed) == (3, 0, 0, 0)
    assert state.cursor is not None and state.cursor.startswith(first)
    hits = await search(client, kb, LONG_QUERIES["glaciers.md"])
    assert hits[0]["uri"] == "docs/glaciers.md" and hits[0]["source_id"] == source.source_id
    assert not [h for h in await search(client, kb, "zebra quagga okapi") if "src/" in h["uri"]]
    doc_id = document_id_for(source.source_id, "docs/glaciers.md")
    shown = (await client.get(f"/v1/documents/{doc_id}")).json()
    assert shown["source_revision"] == first
    assert shown["writer"] == {**shown["writer"], "kind": "source", "name": source.source_id}

    repo.write("docs/espresso.md", TEA)
    (repo.path / "docs" / "consensus").mkdir()
    (repo.path / "docs" / "raft.md").rename(repo.path / "docs" / "consensus" / "raft.md")
    (repo.path / "docs" / "glaciers.md").unlink()
    second = repo.commit("a change, a rename and a deletion")

    state = await sync(rt, source)
    run = state.runs[-1]
    assert run.status == "succeeded" and run.revision == second, run
    # The rename: the old path gone and the new one added; the deletion; the change.
    assert (run.added, run.changed, run.deleted) == (1, 1, 2)
    tea = await search(client, kb, "green tea steeped catechins matcha")
    assert tea[0]["uri"] == "docs/espresso.md"
    assert "catechins" in " ".join(h["content"] for h in tea)
    raft = await search(client, kb, LONG_QUERIES["raft.md"])
    assert raft[0]["uri"] == "docs/consensus/raft.md"
    assert "docs/raft.md" not in {h["uri"] for h in raft}
    glacier_uris = {h["uri"] for h in await search(client, kb, LONG_QUERIES["glaciers.md"])}
    assert "docs/glaciers.md" not in glacier_uris

    chunks = await metric(client, "kbmesh_chunks_embedded_total")
    events = await document_events(rt)
    state = await sync(rt, source)
    run = state.runs[-1]
    assert run.status == "succeeded" and run.revision == second
    assert (run.added, run.changed, run.deleted, run.failed) == (0, 0, 0, 0)
    assert await metric(client, "kbmesh_chunks_embedded_total") == chunks
    assert await document_events(rt) == events


async def test_a_failing_source_keeps_its_documents_and_says_why(stack, daemon: GitDaemon):
    """A source whose repository cannot be fetched (its branch is gone) fails its run with
    git's reason; its documents stay searchable and its cursor stays where it was."""
    rt, client = stack
    kb = await create_kb(client)
    repo = daemon.repo(f"fails-{uid()}")
    repo.write("guide.md", LONG_DOCS["espresso.md"])
    repo.commit("one")
    source = await add_source(rt, kb, repo)
    good = await sync(rt, source)
    assert good.runs[-1].status == "succeeded"
    await rt.registries.sources.put(source.model_copy(update={"branch": "no-such-branch"}))
    state = await sync(rt, source)
    assert state.runs[-1].status == "failed"
    assert "no-such-branch" in (state.runs[-1].error or "")
    assert state.cursor == good.cursor
    hits = await search(client, kb, LONG_QUERIES["espresso.md"])
    assert hits and hits[0]["uri"] == "guide.md"


async def test_two_replicas_never_run_one_source_at_once(stack, daemon: GitDaemon):
    """Two sources services on one bus asked to run one source at the same moment: exactly
    one runs it (the other finds the lease held); once the lease is released, either may."""
    rt, client = stack
    kb = await create_kb(client)
    repo = daemon.repo(f"replicas-{uid()}")
    for i in range(40):
        repo.write(f"notes/{i}.md", f"# Note {i}\n\nnote number {i} about replicas\n")
    repo.commit("forty notes")
    source = await add_source(rt, kb, repo, enabled=False)  # no scheduled run interferes
    fetchers = source_fetchers(rt.settings)
    one = SourcesService(rt.registries, rt.bus.publish, fetchers, holder="replica-one")
    two = SourcesService(rt.registries, rt.bus.publish, fetchers, holder="replica-two")
    first, second = await asyncio.gather(
        one.run(ORG, source.source_id, "manual"), two.run(ORG, source.source_id, "manual")
    )
    finished = [r for r in (first, second) if r is not None]
    assert len(finished) == 1 and finished[0].status == "succeeded", (first, second)
    assert finished[0].added == 40
    assert (
        await rt.registries.sources.leases.get(SourceRegistry.lease_key(ORG, source.source_id))
        is None
    )
    again = await two.run(ORG, source.source_id, "manual")
    assert again is not None and again.status == "succeeded" and again.added == 0
    await settled(rt)
