"""The Sources tab of a knowledge base in headless Chromium: each source with its last run
(status, counts, error) and next run, and "Sync now", which asks the sources service for a
run (a `source.sync` on the bus)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

from playwright.async_api import expect

from services.common.domain.sources import SourceRun, SourceState
from services.common.messages.names import SOURCES_BUCKET, Subject
from tests.browser.conftest import shoot
from tests.support.bus import as_operator


# Public addresses, written as such: a source's hosts pass the egress rule when it is saved,
# and this machine resolves no names.
async def test_sources_tab_shows_runs_and_sync_now_asks_for_one(page, stack, screenshots):
    """A KB with two sources: one that ran (its counts and its error shown) and a paused one
    that never ran. "Sync now" publishes `source.sync` for that source and the button says
    the sync is requested; a source of another KB is not listed."""
    kb = (
        await stack.client.post("/v1/kbs", json={"name": f"synced-{uuid.uuid4().hex[:6]}"})
    ).json()
    other = (
        await stack.client.post("/v1/kbs", json={"name": f"else-{uuid.uuid4().hex[:6]}"})
    ).json()
    repo = (
        await stack.client.post(
            "/v1/sources",
            json={
                "kind": "git",
                "kb": kb["kb_id"],
                "url": "https://93.184.215.14/acme/handbook.git",
                "name": "handbook repository",
                "branch": "main",
            },
        )
    ).json()
    site = (
        await stack.client.post(
            "/v1/sources",
            json={
                "kind": "web",
                "kb": kb["kb_id"],
                "url": "https://93.184.215.14/docs/",
                "name": "product docs",
                "enabled": False,
            },
        )
    ).json()
    elsewhere = await stack.client.post(
        "/v1/sources",
        json={
            "kind": "web",
            "kb": other["kb_id"],
            "url": "https://93.184.215.14/blog/",
            "name": "blog",
        },
    )
    assert repo.get("source_id") and site.get("source_id") and elsewhere.status_code == 201
    # What the sources service records after a run (its state in the `sources` bucket).
    start = datetime.now(UTC) - timedelta(minutes=3)
    run = SourceRun(
        run_id=uuid.uuid4().hex,
        trigger="schedule",
        status="failed",
        started_at=start,
        finished_at=start + timedelta(seconds=12),
        added=41,
        changed=2,
        unchanged=0,
        deleted=1,
        failed=3,
        error="3 files could not be read: docs/big.pdf is larger than 10 MB, ...",
    )
    state = SourceState(
        org_id=stack.rt.settings.default_org,
        source_id=repo["source_id"],
        last_run=run,
        runs=[run],
        next_run_at=datetime.now(UTC) + timedelta(minutes=27),
    )
    async with as_operator(stack.rt) as nc:
        kv = await nc.jetstream().key_value(SOURCES_BUCKET)
        await kv.put(state.key, state.model_dump_json().encode())

    await page.goto(f"/#/kbs/{kb['kb_id']}/sources")
    await expect(page.get_by_role("tab", name="Sources")).to_have_attribute("aria-selected", "true")
    panel = page.get_by_role("tabpanel", name="Sources")
    row = panel.locator(f"tr[data-source='{repo['source_id']}']")
    await expect(row).to_contain_text("handbook repository")
    await expect(row).to_contain_text("Failed")
    await expect(row).to_contain_text("41 added")
    await expect(row).to_contain_text("3 failed")
    await expect(row).to_contain_text("docs/big.pdf is larger than 10 MB")
    paused = panel.locator(f"tr[data-source='{site['source_id']}']")
    await expect(paused).to_contain_text("Never run")
    await expect(paused).to_contain_text("Paused")
    await expect(panel).not_to_contain_text("blog")

    async with as_operator(stack.rt) as nc:
        sub = await nc.subscribe(Subject.SOURCE_SYNC)
        await nc.flush()
        await row.get_by_role("button", name="Sync handbook repository now").click()
        event = json.loads((await sub.next_msg(timeout=10)).data)
    assert event["source_id"] == repo["source_id"] and event["trigger"] == "manual"
    await expect(row.get_by_role("button")).to_have_text("Sync requested")
    await shoot(page, screenshots, "kb-sources")
