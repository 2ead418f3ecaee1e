"""Push to searchable through the webhook, on the default stack.

    .venv/bin/python -m benchmarks.sources_hook [--files 50] [--commits 5]

A repository of `--files` markdown files is served by `git daemon` on loopback; one `kbmesh
up` has a git source on it, added over REST (`POST /v1/sources`, schedule a day, so no
scheduled run takes part) and synced once. Then, `--commits` times: a one-file commit, and
the time from the signed webhook call (`POST /v1/sources/{id}/hook` with
`X-Hub-Signature-256`, as a git host sends it) to the commit's new text being found by
search. The goal: within 5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import hmac
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import kbmesh_up_at
from benchmarks.sources_git import git, git_daemon, make_repository, wait_searchable

# How long the first sync may take before the benchmark gives up.
FIRST_SYNC_SECONDS = 600.0


async def runs(client: httpx.AsyncClient, source_id: str) -> list[dict[str, Any]]:
    r = await client.get(f"/v1/sources/{source_id}")
    r.raise_for_status()
    found: list[dict[str, Any]] = r.json()["status"]["runs"]
    return found


async def first_sync(client: httpx.AsyncClient, source_id: str) -> dict[str, Any]:
    r = await client.post(f"/v1/sources/{source_id}/sync")
    r.raise_for_status()
    deadline = time.monotonic() + FIRST_SYNC_SECONDS
    while time.monotonic() < deadline:
        done = [run for run in await runs(client, source_id) if run["status"] != "running"]
        if done:
            return done[-1]
        await asyncio.sleep(0.2)
    raise TimeoutError("the first sync did not end")


async def searchable(client: httpx.AsyncClient, token: str) -> None:
    while True:
        r = await client.post("/v1/search", json={"query": token, "mode": "keyword", "top_k": 1})
        r.raise_for_status()
        hits = r.json()["hits"]
        if hits and token in hits[0]["content"]:
            return
        await asyncio.sleep(0.02)


async def run(files: int, commits: int) -> None:
    latencies: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp) / "git"
        repo = base_dir / "pages"
        make_repository(repo, files)
        with (
            git_daemon(base_dir) as port,
            kbmesh_up_at(Path(tmp) / "data", KBMESH_EGRESS__ALLOW_PRIVATE="true") as base,
        ):
            async with httpx.AsyncClient(base_url=base, timeout=600) as client:
                await client.get("/v1/kbs/default/stats")  # the default KB, created on use
                r = await client.post(
                    "/v1/sources",
                    json={
                        "kind": "git",
                        "kb": "default",
                        "url": f"git://127.0.0.1:{port}/pages",
                        "name": "bench-hook",
                        "schedule": "1d",
                    },
                )
                r.raise_for_status()
                made = r.json()
                first = await first_sync(client, made["source_id"])
                assert first["status"] == "succeeded", first
                await wait_searchable(client, files)
                for i in range(commits):
                    token = f"hookzq{i}marker"
                    page = repo / "docs" / "section-00" / f"page-{i:04}.md"
                    page.write_text(page.read_text() + f"\nchanged {token}\n")
                    git(repo, "commit", "-q", "-am", f"change {i}")
                    commit = git(repo, "rev-parse", "HEAD").strip()
                    body = json.dumps({"ref": "refs/heads/main", "after": commit}).encode()
                    digest = hmac.new(
                        made["webhook_secret"].encode(), body, hashlib.sha256
                    ).hexdigest()
                    started = time.perf_counter()
                    r = await client.post(
                        made["hook_path"],
                        content=body,
                        headers={
                            "X-Hub-Signature-256": f"sha256={digest}",
                            "Content-Type": "application/json",
                            "X-GitHub-Event": "push",
                        },
                    )
                    assert r.status_code == 202 and r.json()["status"] == "requested", r.text
                    await searchable(client, token)
                    latencies.append(time.perf_counter() - started)

    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(
        f"repository {files} files, git daemon on loopback; first sync {first['added']} files "
        f"in {first_ended(first):.2f} s"
    )
    print(
        f"hook call → searchable, {commits} one-file commits: median "
        f"{statistics.median(latencies):.2f} s, max {max(latencies):.2f} s "
        f"({', '.join(f'{s:.2f}' for s in latencies)})"
    )


def first_ended(run_: dict[str, Any]) -> float:
    started = datetime.datetime.fromisoformat(run_["started_at"])
    finished = datetime.datetime.fromisoformat(run_["finished_at"])
    return (finished - started).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=50)
    parser.add_argument("--commits", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(run(args.files, args.commits))


if __name__ == "__main__":
    main()
