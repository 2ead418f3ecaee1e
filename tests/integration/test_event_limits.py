"""Events from upstream publishers meet the same rules as the REST edge: unknown fields,
wildcard ids, another org's objects, documents outside the publisher's scope and fields over
the limits are dead-lettered at once (first delivery) and change nothing."""

from __future__ import annotations

import json

import pytest

from services.common.messages.events import DocDeleted, DocUploaded
from services.common.messages.names import Subject
from tests.conftest import running_stack
from tests.support.domain import create_kb, dead_letters, registry_counts, settled, upload

ORG = "local"


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    async with running_stack(tmp_path_factory.mktemp("events"), embedders=embedders) as s:
        yield s


async def publish_raw(rt, subject: str, payload: dict) -> str:
    """Publish JSON as an upstream system would: no pydantic model on the way."""
    event_id = payload.setdefault("event_id", f"raw-{len(json.dumps(payload))}-{id(payload)}")
    await rt.bus.js.publish(
        subject, json.dumps(payload).encode(), headers={"Nats-Msg-Id": event_id}
    )
    return event_id


async def test_malformed_and_hostile_events_are_dead_lettered_at_once(stack):
    """Each of these goes to dlq.<subject> on its first delivery and leaves KBs, documents,
    objects and vectors as they were: an unknown field; doc.deleted with the ids '*' and '>';
    an object_ref naming another org's object; 10,000 tags; metadata nested 50 deep; a NUL in
    a tag; a uri of 100,000 characters; whitespace-only text."""
    rt, client = stack
    victim = await upload(client, "other-org.txt", "text of another org", tags=["t"])
    other_org_object = f"{ORG}/{victim['document_id']}/original"
    await settled(rt)
    before = await registry_counts(rt)

    deep: dict = {}
    node = deep
    for _ in range(50):
        node["x"] = {}
        node = node["x"]
    base = {"org_id": ORG, "name": "n.txt", "content": "some text"}
    cases = {
        "unknown field": (Subject.DOC_UPLOADED, {**base, "colection": "typo"}),
        "ids *": (Subject.DOC_DELETED, {"org_id": ORG, "document_ids": ["*"]}),
        "ids >": (Subject.DOC_DELETED, {"org_id": ORG, "document_ids": [">"]}),
        "other org object": (
            Subject.DOC_UPLOADED,
            {"org_id": "intruder", "name": "n.txt", "object_ref": other_org_object},
        ),
        "too many tags": (Subject.DOC_UPLOADED, {**base, "tags": [f"t{i}" for i in range(10_000)]}),
        "deep metadata": (Subject.DOC_UPLOADED, {**base, "metadata": deep}),
        "NUL in a tag": (Subject.DOC_UPLOADED, {**base, "tags": ["a\x00b"]}),
        "long uri": (Subject.DOC_UPLOADED, {**base, "uri": "https://x/" + "a" * 100_000}),
        "whitespace only": (Subject.DOC_UPLOADED, {**base, "content": " \n\t "}),
    }
    ids = {
        name: await publish_raw(rt, subject, dict(body)) for name, (subject, body) in cases.items()
    }
    await settled(rt)
    letters = {
        **await dead_letters(rt, Subject.DOC_UPLOADED),
        **await dead_letters(rt, Subject.DOC_DELETED),
    }
    for name, event_id in ids.items():
        assert event_id in letters, name
        assert letters[event_id]["Kbmesh-Delivered"] == "1", name
        assert letters[event_id]["Kbmesh-Error-Type"] == "ValidationError", (
            name,
            letters[event_id],
        )
    assert await registry_counts(rt) == before
    assert (await client.get(f"/v1/documents/{victim['document_id']}")).status_code == 200


async def test_an_upload_scoped_to_one_kb_cannot_replace_a_document_of_another(stack):
    """doc.uploaded carrying the uploader's scope and the id of a document in a KB outside it
    is refused (Conflict, with the same words as for an id taken concurrently) and the
    document keeps its content, tags and KB; inside the scope the same replacement works."""
    rt, client = stack
    mine, theirs = await create_kb(client), await create_kb(client)
    r = await client.post(
        f"/v1/kbs/{theirs['kb_id']}/documents?wait=true",
        json={"name": "secret.txt", "content": "the other team's secret plan", "tags": ["s"]},
    )
    secret = r.json()
    event = DocUploaded(
        org_id=ORG,
        document_id=secret["document_id"],
        name="hijack.txt",
        content="overwritten",
        kb_id=mine["kb_id"],
        scope_kb_ids=[mine["kb_id"]],
    )
    await rt.bus.publish(Subject.DOC_UPLOADED, event)
    await settled(rt)
    letter = (await dead_letters(rt, Subject.DOC_UPLOADED))[event.event_id]
    assert letter["Kbmesh-Error-Type"] == "Conflict"
    assert "is not available; choose another id" in letter["Kbmesh-Error"]
    view = (await client.get(f"/v1/documents/{secret['document_id']}")).json()
    assert view["name"] == "secret.txt" and view["kb_ids"] == [theirs["kb_id"]]
    assert view["revision"] == secret["revision"]

    allowed = DocUploaded(
        org_id=ORG,
        document_id=secret["document_id"],
        name="replaced.txt",
        content="replaced within scope",
        kb_id=theirs["kb_id"],
        scope_kb_ids=[theirs["kb_id"]],
    )
    await rt.bus.publish(Subject.DOC_UPLOADED, allowed)
    await settled(rt)
    view = (await client.get(f"/v1/documents/{secret['document_id']}")).json()
    assert view["name"] == "replaced.txt"


async def test_a_late_redelivery_does_not_undo_a_newer_upload(stack):
    """Upload A then upload B of one document; A arriving again (a redelivery past the
    de-duplication window) is recognised as applied and changes nothing."""
    rt, client = stack
    first = DocUploaded(org_id=ORG, document_id="redelivered", name="a.txt", content="first text")
    await rt.bus.publish(Subject.DOC_UPLOADED, first)
    await settled(rt)
    second = DocUploaded(org_id=ORG, document_id="redelivered", name="b.txt", content="second")
    await rt.bus.publish(Subject.DOC_UPLOADED, second)
    await settled(rt)
    # Past JetStream's duplicate window the same event id is delivered again.
    await rt.bus.js.publish(
        Subject.DOC_UPLOADED,
        first.model_dump_json().encode(),
        headers={"Nats-Msg-Id": f"again-{first.event_id}"},
    )
    await settled(rt)
    view = (await client.get("/v1/documents/redelivered")).json()
    assert view["name"] == "b.txt" and view["revision"] == 2


async def test_delete_by_wildcard_is_refused_not_retried(stack):
    """DocDeleted's model itself refuses '*' (the contract says ids), so a Python publisher
    learns at once too."""
    with pytest.raises(ValueError):
        DocDeleted(org_id=ORG, document_ids=["*"])
