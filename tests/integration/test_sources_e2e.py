"""Sources through the product, as a client uses them: a web site and a git repository added
over REST, run by "sync now" and by a signed webhook, answered by search; a source moved to
another KB (or given other tags) re-places the documents it already sent; a KB that sources
feed is not deleted from under them."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.bus.registry import SourceRegistry
from services.common.domain.sources import Source, SourceSecrets
from services.common.messages.events import SourceSync
from services.common.messages.names import Subject
from services.common.settings import EgressSettings
from tests.conftest import running_stack
from tests.support.domain import LONG_DOCS, LONG_QUERIES, create_kb, settled, uid, wait_until
from tests.support.gitserver import GitDaemon, git_daemon
from tests.support.website import (
    TOPICS,
    generate_site,
    page_html,
    serve_site,
    topic_body,
    write_page,
)

RUN_SECONDS = 120.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Any:
    with git_daemon(tmp_path_factory.mktemp("git")) as d:
        yield d


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    # Loopback is a private address: allowed here as the test's git and web servers live
    # there, nothing else private.
    async with running_stack(
        tmp_path_factory.mktemp("sources-e2e"),
        embedders=embedders,
        egress=EgressSettings(allowlist=["127.0.0.1"]),
    ) as (rt, client):
        yield SimpleNamespace(rt=rt, client=client, org=rt.settings.default_org)


async def add_source(client: Any, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/sources", json={"name": f"src-{uid()}", **body})
    assert r.status_code == 201, r.text
    made: dict[str, Any] = r.json()
    return made


async def runs_of(client: Any, source_id: str) -> dict[str, Any]:
    r = await client.get(f"/v1/sources/{source_id}")
    assert r.status_code == 200, r.text
    status: dict[str, Any] = r.json()["status"]
    return status


async def ran(stack: Any, source_id: str, before: int) -> dict[str, Any]:
    """The source's newest run once a run after the `before` first ones has ended and no
    sync is asked for any more (the state record the sources service writes)."""
    key = SourceRegistry.state_key(stack.org, source_id)
    ok, state = await stack.rt.registries.sources.states.wait_for(
        key,
        lambda s: s is not None and len(s.runs) > before and s.requested is None,
        RUN_SECONDS,
    )
    assert ok and state is not None, state
    await settled(stack.rt)
    return (await runs_of(stack.client, source_id))["runs"][-1]


async def sync_now(stack: Any, source_id: str) -> dict[str, Any]:
    """POST /v1/sources/{id}/sync, then the run it asked for, ended."""
    before = len((await runs_of(stack.client, source_id))["runs"])
    r = await stack.client.post(f"/v1/sources/{source_id}/sync")
    assert r.status_code == 202, r.text
    return await ran(stack, source_id, before)


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


def signed(secret: str, body: bytes) -> dict[str, str]:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {"X-Hub-Signature-256": f"sha256={digest}", "Content-Type": "application/json"}


LIGHTHOUSE = (
    "Lighthouse keepers trimmed the lamp wicks every night and wound the clockwork that "
    "turned the Fresnel lens, so that each light flashed its own pattern to passing ships."
)


async def test_a_web_site_added_over_rest_is_searchable_and_follows_its_pages(stack, tmp_path):
    """POST /v1/sources (kind web, a site on loopback) and "sync now" → search answers from
    the crawled pages, by their URLs; a page changed and one removed on the server → after
    the next sync search finds the new text and no longer the removed page; a sync with
    nothing changed embeds nothing."""
    client = stack.client
    kb = await create_kb(client)
    root = generate_site(tmp_path / "site")
    try:
        async with serve_site(root) as base:
            made = await add_source(
                client, kind="web", kb=kb["name"], url=f"{base}/docs/index.html", rate=100.0
            )
            run = await sync_now(stack, made["source_id"])
            assert run["status"] == "succeeded", run
            assert run["added"] == len(TOPICS) + 1 and run["failed"] == 0, run
            hits = await search(client, kb, TOPICS["glaciers"])
            assert hits and hits[0]["uri"] == f"{base}/docs/glaciers.html", hits
            assert hits[0]["source_id"] == made["source_id"]
            caves = await search(client, kb, TOPICS["caves"])
            assert caves[0]["uri"] == f"{base}/docs/caves.html"

            nav = list(TOPICS)
            write_page(
                root / "docs/tides.html",
                page_html("Tides", topic_body("lighthouses", LIGHTHOUSE), nav),
            )
            (root / "docs/caves.html").unlink()
            run = await sync_now(stack, made["source_id"])
            assert run["status"] == "succeeded", run
            assert (run["changed"], run["deleted"]) == (1, 1), run
            light = await search(client, kb, "lighthouse keepers Fresnel lens clockwork")
            assert light[0]["uri"] == f"{base}/docs/tides.html"
            assert "Fresnel" in " ".join(h["content"] for h in light)
            assert f"{base}/docs/caves.html" not in {
                h["uri"] for h in await search(client, kb, TOPICS["caves"])
            }

            chunks = await metric(client, "kbmesh_chunks_embedded_total")
            run = await sync_now(stack, made["source_id"])
            assert run["status"] == "succeeded", run
            assert (run["added"], run["changed"], run["deleted"]) == (0, 0, 0), run
            assert run["unchanged"] >= len(TOPICS) - 1
            assert await metric(client, "kbmesh_chunks_embedded_total") == chunks
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def hook_push(stack: Any, made: dict[str, Any], commit: str) -> dict[str, Any]:
    """A git host's push event for `commit`, signed with the source's webhook secret."""
    body = json.dumps({"ref": "refs/heads/main", "after": commit}).encode()
    r = await stack.client.post(
        made["hook_path"], content=body, headers=signed(made["webhook_secret"], body)
    )
    assert r.status_code == 202, r.text
    ack: dict[str, Any] = r.json()
    return ack


async def test_a_signed_push_makes_a_commit_searchable_without_waiting_for_the_schedule(
    stack, daemon: GitDaemon
):
    """A git source added over REST (schedule: a day); a one-file commit, then the webhook
    signed with the secret the creation answered → the commit's text is searchable, its
    document at the pushed commit, long before the schedule would run it."""
    client = stack.client
    kb = await create_kb(client)
    repo = daemon.repo(f"hook-{uid()}")
    repo.write("docs/raft.md", LONG_DOCS["raft.md"])
    repo.commit("one document")
    made = await add_source(client, kind="git", kb=kb["name"], url=repo.url, schedule="1d")
    first = await sync_now(stack, made["source_id"])
    assert first["status"] == "succeeded" and first["added"] == 1, first

    repo.write("docs/tea.md", "# Green tea\n\n" + LIGHTHOUSE.replace("Lighthouse", "Tea"))
    commit = repo.commit("one more file")
    before = len((await runs_of(client, made["source_id"]))["runs"])
    ack = await hook_push(stack, made, commit)
    assert ack["status"] == "requested" and ack["trigger"] == "hook"
    run = await ran(stack, made["source_id"], before)
    assert run["trigger"] == "hook" and run["status"] == "succeeded", run
    assert (run["revision"], run["added"]) == (commit, 1), run
    hits = await search(client, kb, "tea keepers Fresnel lens clockwork")
    assert hits[0]["uri"] == "docs/tea.md" and hits[0]["source_id"] == made["source_id"]
    status = await runs_of(client, made["source_id"])
    assert status["next_run_at"] > run["finished_at"]  # the schedule had no part in it


async def kb_documents(client: Any, kb: dict[str, Any]) -> set[str]:
    r = await client.get("/v1/documents", params={"kb": kb["kb_id"], "limit": 100})
    assert r.status_code == 200, r.text
    return {d["uri"] for d in r.json()["items"]}


async def test_a_source_moved_to_another_kb_or_given_new_tags_re_places_its_documents(
    stack, daemon: GitDaemon
):
    """A git source's documents are in its KB. PATCH its kb → the next run (asked for by the
    change itself) sends every document again: they are in the new KB, searchable there, and
    no longer in the old one, though not one file changed. PATCH its tags → its documents
    carry them after the run."""
    client = stack.client
    old, new = await create_kb(client), await create_kb(client)
    repo = daemon.repo(f"moves-{uid()}")
    for name in ("raft.md", "glaciers.md"):
        repo.write(name, LONG_DOCS[name])
    repo.commit("two documents")
    made = await add_source(client, kind="git", kb=old["name"], url=repo.url, schedule="1d")
    source_id = made["source_id"]
    run = await sync_now(stack, source_id)
    assert run["status"] == "succeeded" and run["added"] == 2, run
    assert await kb_documents(client, old) == {"raft.md", "glaciers.md"}

    before = len((await runs_of(client, source_id))["runs"])
    r = await client.patch(f"/v1/sources/{source_id}", json={"kb": new["name"]})
    assert r.status_code == 200 and r.json()["kb_id"] == new["kb_id"], r.text
    run = await ran(stack, source_id, before)
    assert run["status"] == "succeeded" and run["changed"] == 2, run
    assert await kb_documents(client, new) == {"raft.md", "glaciers.md"}
    assert await kb_documents(client, old) == set()
    hits = await search(client, new, LONG_QUERIES["raft.md"])
    assert hits and hits[0]["uri"] == "raft.md"
    assert not await search(client, old, LONG_QUERIES["raft.md"])

    before = len((await runs_of(client, source_id))["runs"])
    r = await client.patch(f"/v1/sources/{source_id}", json={"tags": ["handbook"]})
    assert r.status_code == 200, r.text
    run = await ran(stack, source_id, before)
    assert run["status"] == "succeeded" and run["changed"] == 2, run
    r = await client.get("/v1/documents", params={"kb": new["kb_id"], "tag": "handbook"})
    assert {d["uri"] for d in r.json()["items"]} == {"raft.md", "glaciers.md"}, r.text

    # The placement is now the one recorded: a run with nothing new sends nothing.
    run = await sync_now(stack, source_id)
    assert (run["added"], run["changed"], run["deleted"]) == (0, 0, 0), run


async def test_a_kb_that_sources_feed_is_not_deleted(stack):
    """DELETE /v1/kbs/{kb} while sources feed it → 409 naming them, the KB and its sources
    stay; once its sources are removed, the KB is deleted."""
    client = stack.client
    kb = await create_kb(client)
    made = await add_source(
        client, kind="web", kb=kb["name"], url="http://127.0.0.1:9/docs/", enabled=False
    )
    r = await client.delete(f"/v1/kbs/{kb['kb_id']}")
    assert r.status_code == 409, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert made["source_id"] in r.json()["detail"]
    assert (await client.get(f"/v1/kbs/{kb['kb_id']}")).status_code == 200
    assert (await client.get(f"/v1/sources/{made['source_id']}")).status_code == 200

    assert (await client.delete(f"/v1/sources/{made['source_id']}")).status_code == 200
    r = await client.delete(f"/v1/kbs/{kb['kb_id']}")
    assert r.status_code == 200, r.text
    await wait_until(lambda: _gone(client, kb), what="the KB deleted", timeout=30.0)


async def _gone(client: Any, kb: dict[str, Any]) -> bool:
    return (await client.get(f"/v1/kbs/{kb['kb_id']}")).status_code == 404


async def test_a_source_whose_kb_is_gone_fails_its_run_and_sends_nothing(stack, daemon: GitDaemon):
    """A source left feeding a KB that no longer exists (written before KBs fed by sources
    were kept from deletion) fails each run, saying so, and publishes no document."""
    rt = stack.rt
    repo = daemon.repo(f"orphan-{uid()}")
    repo.write("guide.md", LONG_DOCS["espresso.md"])
    repo.commit("one")
    source = Source(
        kind="git",
        kb="gone",
        url=repo.url,
        org_id=stack.org,
        source_id=f"src-{uid()}",
        kb_id=f"kb-{uid()}",
        enabled=False,
    )
    await rt.registries.source_secrets.put(
        rt.registries.source_secrets.key(stack.org, source.source_id),
        SourceSecrets(webhook_secret="not-used-here"),
    )
    await rt.registries.sources.put(source)
    await rt.bus.publish(
        Subject.SOURCE_SYNC, SourceSync(org_id=stack.org, source_id=source.source_id)
    )
    run = await ran(stack, source.source_id, 0)
    assert run["status"] == "failed" and "no longer exists" in run["error"], run
    assert (run["added"], run["changed"]) == (0, 0), run
    records = await rt.registries.documents.of_org(stack.org)
    assert not [r for r in records if r.source_id == source.source_id]
