"""Sources over REST against the real stack: definitions in the org's scope, validation that
answers 4xx and changes nothing, secrets that no answer echoes, "sync now" and the webhook,
which publish `source.sync` on the bus only for calls that prove the source's secret, and
removal with the source's documents."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import nats
import pytest

from services.common.messages.names import SOURCE_SECRETS_BUCKET, SOURCES_BUCKET, Subject
from services.common.settings import EgressSettings
from tests.conftest import running_stack
from tests.support.bus import OperatorKeys, as_operator
from tests.support.domain import create_kb, settled, uid, wait_until
from tests.support.mcp_client import failed, http_session, ok, serve_http

REMOTE = "https://127.0.0.1:1/team/handbook.git"
TOKEN = "ghp_" + "s3cr3t" * 6


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    """Two KBs, `mine` and `theirs`; an org-wide key (the client's default), a writable key
    limited to `mine`, a read-only key of the same org. Loopback is allowed as a source
    address (the test's git and web servers live there), nothing else private."""
    async with running_stack(
        tmp_path_factory.mktemp("sources"),
        embedders=embedders,
        egress=EgressSettings(allowlist=["127.0.0.1"]),
    ) as (rt, client):
        mine = await create_kb(client, name=f"mine-{uid()}")
        theirs = await create_kb(client, name=f"theirs-{uid()}")
        keys = OperatorKeys(rt)
        org = rt.settings.default_org
        admin = await keys.create(org, "admin")
        writer = await keys.create(org, "writer", kb_ids=[mine["kb_id"]])
        reader = await keys.create(org, "reader", read_only=True)
        client.headers["Authorization"] = f"Bearer {admin}"
        yield SimpleNamespace(
            rt=rt,
            client=client,
            mine=mine,
            theirs=theirs,
            admin_key=admin,
            writer_key=writer,
            writer={"Authorization": f"Bearer {writer}"},
            reader={"Authorization": f"Bearer {reader}"},
        )


@contextlib.asynccontextmanager
async def bus_events(rt: Any, subject: str) -> AsyncIterator[Any]:
    """A subscription to `subject` as the operator: what the gateway publishes there."""
    async with as_operator(rt) as nc:
        sub = await nc.subscribe(subject)
        await nc.flush()
        try:
            yield sub
        finally:
            await sub.unsubscribe()


async def next_event(sub: Any, timeout: float = 10.0) -> dict[str, Any]:
    msg = await sub.next_msg(timeout=timeout)
    event: dict[str, Any] = json.loads(msg.data)
    return event


def problem(r: Any, status: int, field: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body: dict[str, Any] = r.json()
    if field is not None:
        fields = {body.get("field")} | {e["field"] for e in body.get("errors") or []}
        assert field in fields, body
    return body


def signed(secret: str, body: bytes) -> dict[str, str]:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {"X-Hub-Signature-256": f"sha256={digest}", "Content-Type": "application/json"}


def gitlab_token(secret: str) -> dict[str, str]:
    return {"X-Gitlab-Token": secret, "Content-Type": "application/json"}


async def add_git(
    client: Any, kb: str, headers: dict[str, str] | None = None, **body: Any
) -> dict[str, Any]:
    r = await client.post(
        "/v1/sources",
        json={"kind": "git", "kb": kb, "url": REMOTE, "name": f"src-{uid()}", **body},
        headers=headers,
    )
    assert r.status_code == 201, r.text
    found: dict[str, Any] = r.json()
    return found


async def test_a_source_is_created_listed_shown_and_changed_without_echoing_secrets(stack):
    """POST /v1/sources answers 201 with the definition, its KB's id, `has_credentials` and
    the webhook secret (shown this once); the token is in no answer; GET shows the source by
    id and by name without any secret; PATCH changes only the fields given, and a
    `rotate_webhook_secret` answers a new secret, once."""
    client = stack.client
    name = f"handbook-{uid()}"
    r = await client.post(
        "/v1/sources",
        json={
            "kind": "git",
            "kb": stack.mine["name"],
            "url": REMOTE,
            "name": name,
            "branch": "main",
            "include": ["docs/**"],
            "schedule": "*/15 * * * *",
            "token": TOKEN,
        },
    )
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["kb_id"] == stack.mine["kb_id"] and made["has_credentials"] is True
    assert made["hook_path"] == f"/v1/sources/{made['source_id']}/hook"
    assert len(made["webhook_secret"]) >= 32 and TOKEN not in r.text
    assert made["status"] == {"last_run": None, "next_run_at": None, "requested": None, "runs": []}

    for ref in (made["source_id"], name):
        shown = await client.get(f"/v1/sources/{ref}")
        assert shown.status_code == 200, shown.text
        assert shown.json()["source_id"] == made["source_id"]
        assert shown.json()["webhook_secret"] is None
        assert TOKEN not in shown.text and made["webhook_secret"] not in shown.text
    listed = await client.get("/v1/sources", params={"kb": stack.mine["kb_id"]})
    assert made["source_id"] in [s["source_id"] for s in listed.json()["items"]]
    assert TOKEN not in listed.text and made["webhook_secret"] not in listed.text

    r = await client.patch(f"/v1/sources/{made['source_id']}", json={"schedule": "30m"})
    assert r.status_code == 200, r.text
    changed = r.json()
    assert changed["schedule"] == "30m" and changed["branch"] == "main"
    assert changed["include"] == ["docs/**"] and changed["has_credentials"] is True
    assert changed["webhook_secret"] is None and TOKEN not in r.text

    r = await client.patch(f"/v1/sources/{made['source_id']}", json={"rotate_webhook_secret": True})
    rotated = r.json()["webhook_secret"]
    assert rotated and rotated != made["webhook_secret"]
    r = await client.patch(f"/v1/sources/{made['source_id']}", json={"clear_credentials": True})
    assert r.json()["has_credentials"] is False
    async with as_operator(stack.rt) as nc:
        kv = await nc.jetstream().key_value(SOURCE_SECRETS_BUCKET)
        kept = json.loads(
            (await kv.get(f"{stack.rt.settings.default_org}.{made['source_id']}")).value
        )
    assert kept["token"] is None and kept["webhook_secret"] == rotated


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"schedule": "every tuesday"}, 422, "schedule"),
        ({"schedule": "10s"}, 422, "schedule"),
        ({"sitemap": "https://127.0.0.1/sitemap.xml"}, 422, None),  # a web field on git
        ({"kb": "no-such-kb"}, 404, "kb_id"),
        ({"url": "/srv/repos/handbook"}, 422, "url"),  # a local path, by an API caller
        ({"url": "ftp://127.0.0.1/handbook.git"}, 422, "url"),
        ({"url": "https://10.20.30.40/handbook.git"}, 403, "url"),  # a private address
        ({"url": "https://" + "a" * 70 + ".example/h.git"}, 422, "url"),  # no DNS name
        ({"ssh_key": "-----BEGIN OPENSSH PRIVATE KEY-----"}, 422, "ssh_key"),  # on https
        ({"colour": "blue"}, 422, "colour"),
        ({"source_id": "has a space"}, 422, "source_id"),
    ],
)
async def test_an_invalid_source_is_refused_with_a_4xx_problem_and_nothing_is_stored(
    stack, body, status, field
):
    """Each wrong definition — a bad schedule, fields of the other kind, an unknown KB, a
    local path or another scheme from an API caller, a private address, credentials that do
    not fit the URL, an unknown field, a bad id — gets a problem naming the field; the org's
    sources are as they were."""
    client = stack.client
    before = (await client.get("/v1/sources")).json()["total"]
    r = await client.post(
        "/v1/sources",
        json={"kind": "git", "kb": stack.mine["kb_id"], "url": REMOTE, **body},
    )
    problem(r, status, field)
    assert (await client.get("/v1/sources")).json()["total"] == before


async def test_a_web_source_refuses_git_fields_and_private_start_urls(stack):
    """A web source with a branch is refused (422); one whose sitemap is on a private address
    too (403, naming `sitemap`); PATCH to a bad schedule or null url answers 422 and leaves
    the source unchanged."""
    client = stack.client
    web = {"kind": "web", "kb": stack.mine["kb_id"], "url": "http://127.0.0.1:1/docs/"}
    body = problem(await client.post("/v1/sources", json={**web, "branch": "main"}), 422)
    assert "branch" in body["detail"]
    problem(
        await client.post("/v1/sources", json={**web, "sitemap": "http://192.168.9.9/s.xml"}),
        403,
        "sitemap",
    )
    r = await client.post("/v1/sources", json={**web, "max_pages": 50, "rate": 2})
    assert r.status_code == 201, r.text
    made = r.json()
    problem(await client.patch(f"/v1/sources/{made['source_id']}", json={"schedule": "x"}), 422)
    problem(await client.patch(f"/v1/sources/{made['source_id']}", json={"url": None}), 422, "url")
    problem(await client.patch(f"/v1/sources/{made['source_id']}", json={"branch": "main"}), 422)
    shown = (await client.get(f"/v1/sources/{made['source_id']}")).json()
    assert shown["schedule"] == made["schedule"] and shown["url"] == made["url"]


async def test_scoped_keys_manage_only_their_kbs_sources_and_read_only_keys_only_read(stack):
    """A key limited to `mine` adds sources to `mine`, not to `theirs` (404); a source of
    `theirs` is invisible to it (absent from the list; 404 on show, change, sync and
    removal). A read-only key lists and shows sources and is refused (403) every change."""
    client = stack.client
    theirs = await add_git(client, stack.theirs["kb_id"])
    r = await client.post(
        "/v1/sources",
        headers=stack.writer,
        json={"kind": "git", "kb": stack.theirs["kb_id"], "url": REMOTE},
    )
    problem(r, 404, "kb_id")
    r = await client.post(
        "/v1/sources",
        headers=stack.writer,
        json={"kind": "git", "kb": stack.mine["kb_id"], "url": REMOTE},
    )
    assert r.status_code == 201, r.text
    own = r.json()

    listed = (await client.get("/v1/sources", headers=stack.writer)).json()["items"]
    assert own["source_id"] in [s["source_id"] for s in listed]
    assert theirs["source_id"] not in [s["source_id"] for s in listed]
    ref = f"/v1/sources/{theirs['source_id']}"
    problem(await client.get(ref, headers=stack.writer), 404)
    problem(await client.patch(ref, headers=stack.writer, json={"enabled": False}), 404)
    problem(await client.post(f"{ref}/sync", headers=stack.writer), 404)
    problem(await client.delete(ref, headers=stack.writer), 404)
    # Tags that would put the source's documents into a KB outside its scope are refused.
    r = await client.patch(
        f"/v1/sources/{own['source_id']}",
        headers=stack.writer,
        json={"tags": [f"kb:{stack.theirs['kb_id']}"]},
    )
    problem(r, 403, "tags")
    # Moving its own source into a KB outside its scope is refused too.
    r = await client.patch(
        f"/v1/sources/{own['source_id']}", headers=stack.writer, json={"kb": stack.theirs["kb_id"]}
    )
    problem(r, 404, "kb_id")

    assert (await client.get(ref, headers=stack.reader)).status_code == 200
    assert (await client.get("/v1/sources", headers=stack.reader)).json()["total"] >= 2
    problem(
        await client.post(
            "/v1/sources",
            headers=stack.reader,
            json={"kind": "git", "kb": stack.mine["kb_id"], "url": REMOTE},
        ),
        403,
    )
    problem(await client.patch(ref, headers=stack.reader, json={"enabled": False}), 403)
    problem(await client.post(f"{ref}/sync", headers=stack.reader), 403)
    problem(await client.delete(ref, headers=stack.reader), 403)
    assert (await client.get(ref)).json()["enabled"] is True


async def test_sync_now_publishes_a_manual_source_sync(stack):
    """POST /v1/sources/{id}/sync answers 202 and publishes `source.sync` with trigger
    `manual`, the source's org and id, and the caller as writer."""
    made = await add_git(stack.client, stack.mine["kb_id"])
    async with bus_events(stack.rt, Subject.SOURCE_SYNC) as sub:
        r = await stack.client.post(f"/v1/sources/{made['source_id']}/sync")
        assert r.status_code == 202, r.text
        assert r.json() == {
            "status": "requested",
            "source_id": made["source_id"],
            "trigger": "manual",
            "documents_deleted": None,
        }
        event = await next_event(sub)
    assert event["source_id"] == made["source_id"] and event["trigger"] == "manual"
    assert event["org_id"] == stack.rt.settings.default_org
    assert event["writer"]["kind"] == "key" and event["writer"]["name"] == "admin"


async def test_only_a_hook_signed_with_the_sources_secret_publishes_a_sync(stack):
    """The webhook takes no API key. Unsigned, wrongly signed, signed with a rotated-out
    secret, or naming an unknown source: 401 with one and the same body, nothing published.
    Signed with HMAC-SHA256 (X-Hub-Signature-256) or carrying the token (X-Gitlab-Token):
    202 and `source.sync` with trigger `hook`. A push to another branch is ignored, a ping
    answered; refused calls are on the audit trail."""
    client = stack.client
    made = await add_git(client, stack.mine["kb_id"], branch="main")
    old = made["webhook_secret"]
    rotated = await client.patch(
        f"/v1/sources/{made['source_id']}", json={"rotate_webhook_secret": True}
    )
    secret = rotated.json()["webhook_secret"]
    hook = made["hook_path"]
    push = json.dumps({"ref": "refs/heads/main", "after": "0" * 40}).encode()

    async with bus_events(stack.rt, Subject.SOURCE_SYNC) as sub:
        refusals = [
            await client.post(hook, content=push, headers={"Content-Type": "application/json"}),
            await client.post(hook, content=push, headers=signed("wrong", push)),
            await client.post(hook, content=push, headers=signed(old, push)),
            await client.post(hook, content=push, headers=gitlab_token(old)),
            await client.post(hook, content=push + b" ", headers=signed(secret, push)),
            await client.post(
                f"/v1/sources/{uid()}{uid()}/hook", content=push, headers=signed(secret, push)
            ),
        ]
        for r in refusals:
            problem(r, 401)
            assert r.json() == refusals[0].json()
        # Without the org-wide key too: the hook never looks at API keys.
        saved = client.headers.pop("Authorization")
        try:
            good = await client.post(hook, content=push, headers=signed(secret, push))
            assert good.status_code == 202, good.text
            assert good.json()["status"] == "requested" and good.json()["trigger"] == "hook"
            # The first event on the bus is the good call's: no refused call published one.
            event = await next_event(sub)
            assert event["source_id"] == made["source_id"] and event["trigger"] == "hook"
            assert event["writer"]["kind"] == "hook"

            gitlab = await client.post(hook, content=push, headers=gitlab_token(secret))
            assert gitlab.status_code == 202, gitlab.text
            assert (await next_event(sub))["trigger"] == "hook"

            other = json.dumps({"ref": "refs/heads/feature"}).encode()
            r = await client.post(hook, content=other, headers=signed(secret, other))
            assert r.status_code == 202 and r.json()["status"] == "ignored", r.text
            ping = await client.post(
                hook, content=b"{}", headers={**signed(secret, b"{}"), "X-GitHub-Event": "ping"}
            )
            assert ping.json()["status"] == "pong", ping.text
            # A GitHub form-encoded delivery is verified over its raw bytes as well.
            form = b"payload=" + push.replace(b" ", b"+")
            r = await client.post(
                hook,
                content=form,
                headers={
                    **signed(secret, form),
                    "Content-Type": "application/x-www-form-urlencoded",
                },
            )
            assert r.status_code == 202 and r.json()["status"] == "requested", r.text
            assert (await next_event(sub))["trigger"] == "hook"
        finally:
            client.headers["Authorization"] = saved
    audit = await wait_until(
        lambda: _refusals(client, made["source_id"]), what="the refused call's audit entry"
    )
    assert audit[0]["writer"]["kind"] == "hook" and "unsigned" in audit[0]["error"]


async def _refusals(client: Any, source_id: str) -> list[dict[str, Any]]:
    r = await client.get("/v1/audit", params={"kind": "source", "action": "refused"})
    assert r.status_code == 200, r.text
    return [e for e in r.json()["items"] if e.get("source_id") == source_id]


async def test_a_hook_body_over_the_limit_is_refused_unread(stack):
    """The webhook's body is held to the limit of every small JSON body: 413 before it is
    verified."""
    made = await add_git(stack.client, stack.mine["kb_id"])
    r = await stack.client.post(
        made["hook_path"],
        content=b"x" * (2 * 1024 * 1024),
        headers={"Content-Type": "application/json"},
    )
    problem(r, 413)


async def test_removing_a_source_removes_its_definition_secrets_and_documents(stack, request):
    """DELETE /v1/sources/{id} answers `deleted`; the definition and its secrets are gone from
    their buckets, `doc.deleted` names the source, and ingest removes the documents it
    brought; with keep_documents=true they stay."""
    client = stack.client
    org = stack.rt.settings.default_org
    gone, kept = [await add_git(client, stack.mine["kb_id"]) for _ in range(2)]
    for made in (gone, kept):
        r = await client.post(
            f"/v1/kbs/{stack.mine['kb_id']}/documents?wait=true",
            json={
                "name": "README.md",
                "content": f"written by the source {made['source_id']}",
                "source_id": made["source_id"],
                "uri": "README.md",
            },
        )
        assert r.status_code in (200, 202), r.text
    async with bus_events(stack.rt, Subject.DOC_DELETED) as sub:
        r = await client.delete(f"/v1/sources/{gone['source_id']}")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "deleted" and r.json()["documents_deleted"] is True
        event = await next_event(sub)
    assert event["source_id"] == gone["source_id"] and event["org_id"] == org
    r = await client.delete(f"/v1/sources/{kept['source_id']}", params={"keep_documents": True})
    assert r.json()["documents_deleted"] is False
    problem(await client.get(f"/v1/sources/{gone['source_id']}"), 404)

    async def documents_of(source_id: str) -> list[Any]:
        r = await client.get("/v1/documents", params={"source_id": source_id})
        return list(r.json()["items"])

    async def deleted() -> bool:
        return not await documents_of(gone["source_id"])

    await wait_until(deleted, what="the source's documents deleted")
    assert len(await documents_of(kept["source_id"])) == 1
    async with as_operator(stack.rt) as nc:
        js = nc.jetstream()
        for bucket in (SOURCES_BUCKET, SOURCE_SECRETS_BUCKET):
            kv = await js.key_value(bucket)
            with pytest.raises(nats.js.errors.KeyNotFoundError):
                await kv.get(f"{org}.{gone['source_id']}")


async def test_concurrent_removals_of_one_source_answer_once_deleted(stack):
    """Two removals at once: one answers `deleted`, the other 404 or `deleted` — never a
    500."""
    made = await add_git(stack.client, stack.mine["kb_id"])
    ref = f"/v1/sources/{made['source_id']}"
    answers = await asyncio.gather(stack.client.delete(ref), stack.client.delete(ref))
    assert sorted(r.status_code for r in answers)[0] == 200
    assert all(r.status_code in (200, 404) for r in answers), [r.text for r in answers]


async def test_the_source_tools_manage_sources_over_mcp_with_structured_errors(stack):
    """Over MCP (streamable HTTP): kb_source_add answers the source and its webhook secret,
    kb_source_list and kb_source_get show it without secrets, kb_source_sync publishes a
    manual `source.sync`, kb_source_remove removes it; a bad schedule, a KB outside a scoped
    key's scope and a removed source are structured tool errors naming what is wrong."""
    async with serve_http(stack.rt) as (base, _app), http_session(base, stack.admin_key) as s:
        added = ok(
            await s.call_tool(
                "kb_source_add",
                {
                    "kind": "web",
                    "kb": stack.mine["kb_id"],
                    "url": "http://127.0.0.1:1/docs/",
                    "name": f"docs-{uid()}",
                    "max_pages": 20,
                },
            )
        )
        assert added["webhook_secret"] and added["kind"] == "web"
        listed = ok(await s.call_tool("kb_source_list", {"kb": stack.mine["name"]}))
        assert added["source_id"] in [i["source_id"] for i in listed["items"]]
        assert added["webhook_secret"] not in json.dumps(listed)
        shown = ok(await s.call_tool("kb_source_get", {"source": added["name"]}))
        assert shown["source_id"] == added["source_id"] and shown["webhook_secret"] is None
        async with bus_events(stack.rt, Subject.SOURCE_SYNC) as sub:
            ack = ok(await s.call_tool("kb_source_sync", {"source": added["source_id"]}))
            assert ack["status"] == "requested"
            assert (await next_event(sub))["source_id"] == added["source_id"]
        bad = failed(
            await s.call_tool(
                "kb_source_update", {"source": added["source_id"], "schedule": "often"}
            ),
            "ValidationError",
        )
        assert bad["field"] == "schedule"
        gone = ok(await s.call_tool("kb_source_remove", {"source": added["source_id"]}))
        assert gone["status"] == "deleted"
        missing = failed(
            await s.call_tool("kb_source_get", {"source": added["source_id"]}), "NotFound"
        )
        assert missing["field"] == "source"
    async with serve_http(stack.rt) as (base, _app), http_session(base, stack.writer_key) as s:
        outside = failed(
            await s.call_tool(
                "kb_source_add",
                {"kind": "git", "kb": stack.theirs["kb_id"], "url": REMOTE},
            ),
            "NotFound",
        )
        assert outside["field"] == "kb"


async def test_two_orgs_may_use_one_source_id_and_each_hook_syncs_its_own(stack):
    """Source ids are chosen per org: two orgs with a source `handbook` each; a hook call
    signed with one org's secret syncs that org's source, the other's secret the other's."""
    client = stack.client
    other_org = f"beta-{uid()}"
    key = await OperatorKeys(stack.rt).create(other_org, "beta-admin")
    beta = {"Authorization": f"Bearer {key}"}
    theirs_kb = await client.post("/v1/kbs", headers=beta, json={"name": "handbook"})
    assert theirs_kb.status_code == 201, theirs_kb.text
    shared = f"handbook-{uid()}"
    ours = await add_git(client, stack.mine["kb_id"], source_id=shared)
    r = await client.post(
        "/v1/sources",
        headers=beta,
        json={"kind": "git", "kb": "handbook", "url": REMOTE, "source_id": shared},
    )
    assert r.status_code == 201, r.text
    theirs = r.json()
    body = b'{"ref": "refs/heads/main"}'
    async with bus_events(stack.rt, Subject.SOURCE_SYNC) as sub:
        for made, org in ((theirs, other_org), (ours, stack.rt.settings.default_org)):
            r = await client.post(
                made["hook_path"], content=body, headers=signed(made["webhook_secret"], body)
            )
            assert r.status_code == 202, r.text
            event = await next_event(sub)
            assert (event["org_id"], event["source_id"]) == (org, shared)


async def test_a_scoped_key_removing_a_source_deletes_only_documents_in_its_scope(stack):
    """A key limited to `mine` removes its source: the source's document in `mine` goes, a
    document of the same source id in `theirs` (outside the key's scope) stays."""
    client = stack.client
    made = await add_git(client, stack.mine["kb_id"], headers=stack.writer)
    ids = {}
    for label, kb in (("mine", stack.mine), ("theirs", stack.theirs)):
        r = await client.post(
            f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
            json={
                "name": f"{label}.md",
                "content": f"notes of {label} from {made['source_id']}",
                "source_id": made["source_id"],
                "uri": f"{label}.md",
            },
        )
        assert r.status_code in (200, 202), r.text
        ids[label] = r.json()["document_id"]
    r = await client.delete(f"/v1/sources/{made['source_id']}", headers=stack.writer)
    assert r.status_code == 200, r.text

    # Every event of the removal applied (ingest, then embed), then both looked at.
    await settled(stack.rt)
    assert (await client.get(f"/v1/documents/{ids['mine']}")).status_code == 404
    assert (await client.get(f"/v1/documents/{ids['theirs']}")).status_code == 200
