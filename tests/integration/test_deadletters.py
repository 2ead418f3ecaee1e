"""Dead letters can be read back and replayed once their cause is fixed, through the
library and through `kbmesh dlq`."""

from __future__ import annotations

import json
import subprocess
import sys

from services.common.deadletters import list_dead_letters, replay
from services.common.events import DocUploaded
from tests.conftest import running_stack
from tests.support.domain import wait_until
from tests.support.procs import ROOT, kbmesh_env


async def test_dead_letter_replayed_after_the_cause_is_fixed(tmp_path, embedders):
    """An upload naming a KB that does not exist yet is dead-lettered with the reason;
    `kbmesh dlq list` shows it; after the KB is created, replaying it indexes the
    document there and removes the dead letter."""
    async with running_stack(tmp_path, embedders=embedders) as (rt, client):
        event = DocUploaded(
            org_id="local",
            document_id="late-doc",
            name="late.txt",
            content="written before its knowledge base existed",
            kb_id="later-kb",
        )
        await rt.bus.publish("doc.uploaded", event)

        async def dead() -> list:
            return await list_dead_letters(rt.bus.js, "doc.uploaded")

        (letter,) = await wait_until(dead, timeout=30, what="the dead letter")
        assert letter.error_type == "ValidationError" and "later-kb" in letter.error
        assert json.loads(letter.data)["event_id"] == event.event_id

        listed = subprocess.run(
            [sys.executable, "-m", "services.cli", "dlq", "list", "--subject", "doc.uploaded"],
            cwd=ROOT,
            env=kbmesh_env(KBMESH_NATS_URL=rt.bus.url),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.splitlines()
        assert [json.loads(line)["sequence"] for line in listed] == [letter.sequence]

        r = await client.post("/v1/kbs", json={"name": "later-kb"})
        kb_id = r.json()["kb_id"]
        await replay(rt.bus.js, letter)

        async def indexed() -> dict | None:
            view = (await client.get("/v1/documents/late-doc")).json()
            return view if view.get("status") == "complete" else None

        view = await wait_until(indexed, timeout=60, what="the replayed upload indexed")
        assert kb_id in view["kb_ids"]
        assert await list_dead_letters(rt.bus.js, "doc.uploaded") == []
