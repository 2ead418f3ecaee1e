"""`kbmesh sources add|list|show|sync|remove|apply`, each run in its own process against a real
stack over HTTP: `apply` makes a YAML file of sources true and a second apply changes
nothing; the commands for one source do what their REST calls do."""

from __future__ import annotations

import json
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.settings import EgressSettings
from tests.conftest import running_stack
from tests.support.cli import kbmesh
from tests.support.domain import create_kb, uid
from tests.support.gitserver import git
from tests.support.mcp_client import serve_http


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """Keyless, on loopback: the operator at the gateway's machine (who may name a local
    repository path)."""
    async with (
        running_stack(
            tmp_path_factory.mktemp("sources-cli"),
            embedders=embedders,
            egress=EgressSettings(allowlist=["127.0.0.1"]),
        ) as (rt, client),
        serve_http(rt) as (base, _app),
    ):
        yield client, base


async def sources_of(client: httpx.AsyncClient, kb: str) -> dict[str, dict[str, Any]]:
    r = await client.get("/v1/sources", params={"kb": kb})
    assert r.status_code == 200, r.text
    return {s["source_id"]: s for s in r.json()["items"]}


def declare(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


async def test_apply_makes_the_file_true_and_a_second_apply_changes_nothing(stack, tmp_path):
    """The first apply creates the declared sources (a local repository path, allowed to the
    keyless operator, and a web site); a second apply of the same file changes nothing (no
    source rewritten); a changed file updates one, and removes the one it no longer declares
    and one added by hand to a KB it manages, not a source of another KB; --dry-run only
    prints the plan; an invalid file exits 2 and changes nothing."""
    client, base = stack
    kb = (await create_kb(client, name=f"docs-{uid()}"))["name"]
    other = (await create_kb(client, name=f"other-{uid()}"))["name"]
    repo, site = f"repo-{uid()}", f"site-{uid()}"
    first = declare(
        tmp_path / "sources.yaml",
        f"""
        kbs: [{kb}]
        sources:
          - id: {repo}
            kind: git
            kb: {kb}
            url: {tmp_path / "handbook.git"}
            branch: main
            include: ["docs/**"]
          - id: {site}
            kind: web
            kb: {kb}
            url: http://127.0.0.1:1/docs/
            max_pages: 50
            schedule: "*/30 * * * *"
        """,
    )
    code, out, err = await kbmesh("sources", "apply", str(first), "--api", base)
    assert code == 0, err
    assert f"create {repo}" in out and f"create {site}" in out, out
    made = await sources_of(client, kb)
    assert set(made) == {repo, site}
    assert made[repo]["include"] == ["docs/**"] and made[site]["schedule"] == "*/30 * * * *"

    code, out, err = await kbmesh("sources", "apply", str(first), "--api", base)
    assert code == 0, err
    assert "create 0, update 0, remove 0; 2 unchanged" in out, out
    again = await sources_of(client, kb)
    assert {k: v["updated_at"] for k, v in again.items()} == {
        k: v["updated_at"] for k, v in made.items()
    }

    by_hand = await client.post(
        "/v1/sources", json={"kind": "web", "kb": kb, "url": "http://127.0.0.1:1/blog/"}
    )
    elsewhere = await client.post(
        "/v1/sources", json={"kind": "web", "kb": other, "url": "http://127.0.0.1:1/x/"}
    )
    assert by_hand.status_code == elsewhere.status_code == 201
    second = declare(
        tmp_path / "sources.yaml",
        f"""
        kbs: [{kb}]
        sources:
          - id: {repo}
            kind: git
            kb: {kb}
            url: {tmp_path / "handbook.git"}
            branch: main
            include: ["docs/**", "*.md"]
        """,
    )
    code, out, err = await kbmesh("sources", "apply", str(second), "--dry-run", "--api", base)
    assert code == 0, err
    assert f"would update {repo}: include" in out and f"would remove {site}" in out, out
    assert set(await sources_of(client, kb)) == {repo, site, by_hand.json()["source_id"]}

    code, out, err = await kbmesh("sources", "apply", str(second), "--json", "--api", base)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["updated"] == [repo] and summary["created"] == []
    assert sorted(summary["removed"]) == sorted([site, by_hand.json()["source_id"]])
    left = await sources_of(client, kb)
    assert set(left) == {repo} and left[repo]["include"] == ["docs/**", "*.md"]
    assert elsewhere.json()["source_id"] in await sources_of(client, other)

    broken = declare(
        tmp_path / "broken.yaml",
        f"""
        - id: {repo}
          kind: git
          kb: {kb}
          url: https://127.0.0.1/x.git
          schedule: whenever
        """,
    )
    code, out, err = await kbmesh("sources", "apply", str(broken), "--api", base)
    assert code == 2, (out, err)
    assert "schedule" in err
    assert (await sources_of(client, kb))[repo]["url"] == str(tmp_path / "handbook.git")

    code, out, err = await kbmesh("sources", "apply", str(tmp_path / "nowhere.yaml"), "--api", base)
    assert code == 2 and "cannot read" in err


async def test_add_list_show_sync_and_remove_one_source(stack):
    """`sources add` prints the webhook and its secret once; `list` and `show` show the
    source; `sync` asks for a run; `remove` removes it; a refused call exits 1 with the
    server's reason."""
    client, base = stack
    kb = (await create_kb(client, name=f"cli-{uid()}"))["name"]
    name = f"notes-{uid()}"
    code, out, err = await kbmesh(
        "sources",
        "add",
        "git",
        "https://127.0.0.1:1/acme/notes.git",
        "--kb",
        kb,
        "--name",
        name,
        "--branch",
        "main",
        "--include",
        "*.md",
        "--api",
        base,
    )
    assert code == 0, err
    assert "webhook secret (shown once): " in out and "/hook" in out
    (source,) = (await sources_of(client, kb)).values()
    assert source["name"] == name and source["include"] == ["*.md"]

    code, out, err = await kbmesh("sources", "list", "--kb", kb, "--api", base)
    assert code == 0 and source["source_id"] in out and name in out, (out, err)
    code, out, err = await kbmesh("sources", "show", name, "--api", base)
    assert code == 0 and "branch: main" in out, (out, err)
    code, out, err = await kbmesh("sources", "sync", name, "--api", base)
    assert code == 0 and "requested" in out, (out, err)
    code, out, err = await kbmesh("sources", "remove", name, "--api", base)
    assert code == 0 and "removed" in out, (out, err)
    assert await sources_of(client, kb) == {}
    code, out, err = await kbmesh("sources", "show", name, "--api", base)
    assert code == 1 and "HTTP 404" in err, (out, err)


async def test_sync_wait_exits_with_the_outcome_of_the_run_it_asked_for(stack, tmp_path):
    """`kbmesh sources sync --wait` returns once the run it asked for has ended: exit 0 with
    the run's counts when it succeeded; exit 1 with the run's error when it failed (a branch
    that does not exist), so a script that waits on it stops there."""
    client, base = stack
    kb = (await create_kb(client, name=f"wait-{uid()}"))["name"]
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "guide.md").write_text("# Guide\n\nThe guide says where the kettle is.\n")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "one")
    good, bad = f"good-{uid()}", f"bad-{uid()}"
    for name, branch in ((good, "main"), (bad, "no-such-branch")):
        code, _, err = await kbmesh(
            "sources", "add", "git", str(repo), "--kb", kb, "--id", name, "--branch", branch,
            "--schedule", "1d", "--api", base,
        )  # fmt: skip
        assert code == 0, err

    code, out, err = await kbmesh("sources", "sync", good, "--wait", "--api", base)
    assert code == 0 and "succeeded" in out and "a1" in out, (out, err)
    code, out, err = await kbmesh("sources", "sync", bad, "--wait", "--api", base)
    assert code == 1 and "failed" in err and "no-such-branch" in err, (out, err)
