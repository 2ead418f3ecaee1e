"""Dead letters can be read back and replayed once their cause is fixed, through the
library and through `kbmesh dlq`."""

from __future__ import annotations

import json
import subprocess
import sys

from services.common.bus.deadletters import list_dead_letters, replay
from services.common.messages.events import DocUploaded
from tests.conftest import running_stack
from tests.support.bus import bus_env
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
            env=kbmesh_env(**bus_env(rt, "operator")),
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


async def test_poison_events_of_any_shape_reach_the_dead_letter_subject(tmp_path, embedders):
    """Bodies that no decoder accepts — nesting 20,000 levels deep (too deep for Python's
    JSON parser), bytes that are not UTF-8, JSON that is not an object — are dead-lettered
    on their first delivery, with the original bytes, instead of being redelivered until
    JetStream drops them."""
    bus_settings = {"max_deliver": 3}
    async with running_stack(tmp_path, embedders=embedders, bus=bus_settings) as (rt, _):
        deep = '{"a":' * 20_000 + "1" + "}" * 20_000
        bodies = [
            (
                '{"event_id":"deep","org_id":"local","document_id":"deep","name":"deep.txt",'
                f'"content":"x","metadata":{deep}}}'
            ).encode(),
            b'{"event_id":"latin1","org_id":"local","name":"caf\xe9","content":"x"}',
            b'["not", "an", "object"]',
        ]
        for body in bodies:
            await rt.bus.js.publish(
                "doc.uploaded", body, headers={"content-type": "application/json"}
            )

        async def dead() -> list:
            letters = await list_dead_letters(rt.bus.js, "doc.uploaded")
            return letters if len(letters) == len(bodies) else []

        letters = await wait_until(dead, timeout=30, what="three dead letters")
        assert sorted(letter.data for letter in letters) == sorted(bodies)
        for letter in letters:
            assert letter.error_type == "ValidationError"
            assert letter.error.startswith("malformed event")
            assert 1 <= letter.delivered <= 3
        consumer = await rt.bus.js.consumer_info("KBMESH", "ingest-doc-uploaded")
        assert consumer.num_ack_pending == 0 and consumer.num_redelivered == 0


async def test_dlq_list_prints_error_texts_that_are_not_ascii(tmp_path, embedders):
    """An error naming a value in any script (here an unsupported mime type with an accent,
    a check mark) is read back as written and `kbmesh dlq list` prints
    it as JSON, exit 0; `kbmesh dlq discard` then removes it without replaying it."""
    async with running_stack(tmp_path, embedders=embedders) as (rt, client):
        mime = "application/x-café ✓\nzweite Zeile"
        event = DocUploaded(org_id="local", name="odd.bin", content="x", mime_type=mime)
        await rt.bus.publish("doc.uploaded", event)

        async def dead() -> list:
            return await list_dead_letters(rt.bus.js, "doc.uploaded")

        (letter,) = await wait_until(dead, timeout=30, what="the dead letter")
        listed = subprocess.run(
            [sys.executable, "-m", "services.cli", "dlq", "list"],
            cwd=ROOT,
            env=kbmesh_env(**bus_env(rt, "operator")),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr[-2000:]
        (line,) = listed.stdout.splitlines()
        summary = json.loads(line)
        assert summary["sequence"] == letter.sequence
        assert "application/x-café ✓" in summary["error"] and "\n" not in summary["error"]

        # Its cause will not be fixed (no such type is read): discarded, not replayed.
        discarded = subprocess.run(
            [sys.executable, "-m", "services.cli", "dlq", "discard", str(letter.sequence)],
            cwd=ROOT,
            env=kbmesh_env(**bus_env(rt, "operator")),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert discarded.returncode == 0, discarded.stderr[-2000:]
        assert json.loads(discarded.stdout) == {
            "discarded": letter.sequence,
            "subject": "doc.uploaded",
        }
        assert await list_dead_letters(rt.bus.js, "doc.uploaded") == []
        documents = (await client.get("/v1/documents", params={"name_search": "odd.bin"})).json()
        assert documents["total"] == 0, "a discarded upload is not replayed"


async def test_dead_letters_over_rest_stay_in_their_org_and_scope(tmp_path, embedders):
    """GET /v1/dead-letters shows a caller only its org's dead letters (and, with a KB-scoped
    key, only those naming its KBs); replay needs a writable key that sees the letter; a
    replayed letter is gone from the list and its upload is indexed."""
    from tests.support.bus import OperatorKeys

    async with running_stack(tmp_path, embedders=embedders) as (rt, client):
        resolver = OperatorKeys(rt)
        a = await resolver.create("org-a")
        b = await resolver.create("org-b")
        a_reader = await resolver.create("org-a", read_only=True)
        a_other_kb = await resolver.create("org-a", kb_ids=["someone-else"])

        def auth(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        await rt.bus.publish(
            "doc.uploaded",
            DocUploaded(org_id="org-a", name="early.txt", content="too early", kb_id="soon"),
        )

        async def listed(key: str) -> list[dict]:
            r = await client.get("/v1/dead-letters", headers=auth(key))
            assert r.status_code == 200, r.text
            return r.json()["items"]

        (letter,) = await wait_until(lambda: listed(a), timeout=30, what="org A's dead letter")
        assert letter["subject"] == "doc.uploaded" and letter["name"] == "early.txt"
        assert "soon" in letter["error"] and letter["kb_id"] == "soon"
        assert await listed(b) == []
        assert await listed(a_other_kb) == []
        assert (await client.get("/v1/dead-letters")).status_code == 401

        replay_path = f"/v1/dead-letters/{letter['sequence']}/replay"
        assert (await client.post(replay_path, headers=auth(b))).status_code == 404
        assert (await client.post(replay_path, headers=auth(a_other_kb))).status_code == 404
        assert (await client.post(replay_path, headers=auth(a_reader))).status_code == 403
        assert await listed(a) == [letter]

        kb = await client.post("/v1/kbs", json={"name": "soon"}, headers=auth(a))
        r = await client.post(replay_path, headers=auth(a))
        assert r.status_code == 202 and r.json()["sequence"] == letter["sequence"]
        assert await listed(a) == []

        async def indexed() -> bool:
            r = await client.get(f"/v1/kbs/{kb.json()['kb_id']}/documents", headers=auth(a))
            return [d["status"] for d in r.json()["items"]] == ["complete"]

        await wait_until(indexed, timeout=60, what="the replayed upload indexed")
        assert (await client.post(replay_path, headers=auth(a))).status_code == 404
