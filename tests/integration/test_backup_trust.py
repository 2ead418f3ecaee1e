"""What `kbmesh restore` trusts, and what `kbmesh backup` writes through: archives made here
from a real stack, then damaged, stretched or tampered with the way an attacker holding the
file could, and restored into real stacks.

- Every member is bounded by the manifest and a hard cap, read with a running count: a tiny
  archive declaring a 10 GiB member is refused at once, in bounded memory.
- Every member's SHA-256 is in the manifest and checked; every malformed archive is one
  `BackupError` (the CLI prints it, exits 1, no traceback) and leaves no data dir behind.
- API keys and stored prompts come back only when asked (`--with-keys`, `--with-prompts`);
  what restore prints is what it restored; the restore and every key it brings are audited;
  the audit trail travels in the archive.
- `kbmesh backup` creates its temporary file afresh: a link planted where it writes is never
  followed."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.cli.backup import BackupError, backup, restore
from services.cli.commands import main
from services.common.bus.registry import ApiKey
from services.gateway.auth import hash_key, key_id, new_key
from tests.conftest import running_stack
from tests.support.backups import (
    Members,
    appended_line,
    first,
    kbmesh,
    manifest,
    members_of,
    reseal,
    the_original,
    with_manifest,
    write_archive,
)
from tests.support.bus import OperatorKeys, bus_env, operator_bus
from tests.support.domain import create_kb, uid, upload

GiB = 1 << 30


@dataclass
class Source:
    archive: Path
    org: str
    token: str
    key_id: str
    prompt_id: str
    kb_id: str
    document_id: str


@pytest.fixture(scope="module")
async def source(tmp_path_factory, embedders) -> Source:
    """A backup of a stack with a KB, a document, an org-wide key and a stored prompt."""
    root = tmp_path_factory.mktemp("backup-trust")
    archive = root / "stack.tar.gz"
    async with running_stack(root / "a", embedders=embedders) as (rt, client):
        org = rt.settings.default_org
        kb = await create_kb(client, tag_ids=["facts"])
        doc = await upload(
            client, "ledger.md", "The lighthouse keeper logs every ship.", tags=["facts"]
        )
        token = await OperatorKeys(rt).create(org, "admin")
        client.headers["Authorization"] = f"Bearer {token}"
        prompt = await client.post(
            "/v1/prompts",
            json={"name": f"p-{uid()}", "model": "openai/gpt-4o-mini", "instructions": "Answer."},
        )
        assert prompt.status_code == 201, prompt.text
        async with operator_bus(rt) as bus:
            await backup(bus, archive)
    return Source(
        archive,
        org,
        token,
        key_id(hash_key(token)),
        prompt.json()["prompt_id"],
        kb["kb_id"],
        doc["document_id"],
    )


# --- 1. members are bounded -------------------------------------------------------------


@pytest.mark.parametrize("declared", [True, False], ids=["declared-huge", "declared-as-before"])
async def test_a_tiny_archive_with_a_sparse_10_gib_member_is_refused_at_once_in_bounded_memory(
    source: Source, tmp_path: Path, declared: bool
) -> None:
    """The member's header says 10 GiB (a sparse member: the archive stays a few KB). Whether
    the manifest was edited to say so too or not, restore names the member and stops before
    reading it: within seconds, under a 1 GiB address-space limit, no traceback."""
    members = members_of(source.archive)
    name = the_original(members)
    found = manifest(members)
    for entry in found.get("members", []):
        if entry["name"] == name and declared:
            entry["size"] = 10 * GiB
    archive = write_archive(
        tmp_path / "sparse.tar.gz", with_manifest(members, found), sparse={name: 10 * GiB}
    )
    assert archive.stat().st_size < 64 * 1024

    started = time.monotonic()
    rc, out, err = await kbmesh(
        "restore", str(archive), "--data-dir", str(tmp_path / "d"), address_space=GiB
    )
    took = time.monotonic() - started
    assert rc == 1, (out, err)
    assert "Traceback" not in err and "MemoryError" not in err, err
    assert f"kbmesh restore: {archive}" in err and name in err, err
    peak_kib = int(err.rsplit("peak_kib=", 1)[1].split()[0])
    assert peak_kib < 256 * 1024, err
    assert took < 60, took
    assert not (tmp_path / "d").exists()


# --- 2. malformed archives: one clear error each ------------------------------------------

Build = Callable[[Members, Path], None]


def rewritten(change: Callable[[Members], Members]) -> Build:
    return lambda members, path: (write_archive(path, change(members)), None)[1]


def _manifest_is(change: Callable[[dict], object]) -> Build:
    return rewritten(lambda m: with_manifest(m, change(manifest(m))))


def _without(found: dict, *keys: str) -> dict:
    return {k: v for k, v in found.items() if k not in keys}


def _event_elsewhere(m: Members) -> Members:
    """A pending 'upload' whose subject is not one ingest consumes (kb.index would make embed
    index whatever the archive says)."""
    event = json.dumps({"seq": 1, "subject": "kb.index", "headers": {}, "data": ""})
    if any(n.startswith("events") for n, _ in m):
        return reseal(appended_line(m, "events", event))
    return reseal([*m, ("events/000000.jsonl", event.encode())])


def _link_member(members: Members, path: Path) -> None:
    link = "objects/local/link/original"
    write_archive(path, [*members, (link, b"")], links=(link,))


def _truncated(members: Members, path: Path) -> None:
    write_archive(path, members)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _long_header(members: Members, path: Path) -> None:
    """A 1 MiB extended (pax) header: read whole by tar readers, so it is bounded too."""
    write_archive(path, members, pax={the_original(members): {"comment": "x" * (1 << 20)}})


def _point_changed(change: Callable[[dict], object]) -> Callable[[Members], Members]:
    """A point added to the vector part: the first one, changed (the manifest resealed)."""

    def build(m: Members) -> Members:
        point = json.loads(m[first(m, "vectors/")][1].split(b"\n")[0])
        change(point)
        return reseal(appended_line(m, "vectors/", json.dumps(point)))

    return build


MALFORMED: dict[str, tuple[Build, str]] = {
    "a newer archive version": (_manifest_is(lambda f: {**f, "archive_version": 99}), "newer"),
    "an archive without checksums (version 1)": (
        _manifest_is(lambda f: {**_without(f, "members"), "archive_version": 1}),
        "version 1",
    ),
    "no archive version": (_manifest_is(lambda f: _without(f, "archive_version")), "version"),
    "a version that is no number": (
        _manifest_is(lambda f: {**f, "archive_version": "two"}),
        "version",
    ),
    "a manifest that is a list": (_manifest_is(lambda f: [f]), "manifest.json"),
    "a manifest that is not JSON": (
        rewritten(lambda m: [("manifest.json", b"{ this is not json"), *m[1:]]),
        "manifest.json",
    ),
    "the manifest not first": (rewritten(lambda m: [*m[1:], m[0]]), "manifest.json"),
    "a table line that is not JSON": (
        rewritten(lambda m: reseal(appended_line(m, "kv/kbs", "{ not json"))),
        "kv/kbs",
    ),
    "a table row without a value": (
        rewritten(lambda m: reseal(appended_line(m, "kv/kbs", json.dumps({"key": "local.x"})))),
        "kv/kbs",
    ),
    "a table row that is no KB": (
        rewritten(
            lambda m: reseal(
                appended_line(m, "kv/kbs", json.dumps({"key": "local.x", "value": "[1, 2]"}))
            )
        ),
        "kv/kbs",
    ),
    "a table row that is a list": (
        rewritten(lambda m: reseal(appended_line(m, "kv/documents", "[]"))),
        "kv/documents",
    ),
    "a pending event on a subject ingest does not take": (rewritten(_event_elsewhere), "kb.index"),
    "a member the manifest does not list": (
        rewritten(lambda m: [*m, ("objects/local/planted/original", b"planted")]),
        "objects/local/planted/original",
    ),
    "a listed member missing": (
        rewritten(lambda m: [(n, d) for n, d in m if n != the_original(m)]),
        "/original",
    ),
    "a link member": (_link_member, "objects/local/link/original"),
    "a truncated archive": (_truncated, "damaged"),
    "a 1 MiB extended header": (_long_header, "header"),
    "a point that is no point": (
        rewritten(lambda m: reseal(appended_line(m, "vectors/", json.dumps({"id": "x"})))),
        "vectors/",
    ),
    "a point whose dense vector is no base64": (
        rewritten(_point_changed(lambda p: p.update(dense="not base64!"))),
        "dense",
    ),
    "a point whose dense vector holds NaN": (
        rewritten(_point_changed(lambda p: p.update(dense="AADAfw=="))),
        "finite",
    ),
    "a point of another dimension than its KB's": (
        rewritten(_point_changed(lambda p: p.update(dense="AACAPw=="))),
        "dense numbers",
    ),
    "a point of a KB whose vectors the manifest does not list": (
        rewritten(_point_changed(lambda p: p["payload"].update(kb_id="elsewhere"))),
        "whose vectors are not listed",
    ),
    "vectors in a version 2 archive": (
        _manifest_is(lambda f: {**f, "archive_version": 2, "vectors": []}),
        "not a part of a version 2 archive",
    ),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
async def test_each_malformed_archive_is_one_clear_error_and_changes_nothing(
    source: Source, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """`kbmesh restore` on it prints `kbmesh restore: <archive>: <what is wrong>` naming the
    part at fault and exits 1: never another exception, never a data dir."""
    build, fragment = MALFORMED[kind]
    path = tmp_path / "bad.tar.gz"
    build(members_of(source.archive), path)
    data_dir = tmp_path / "d"
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        # main() runs its own event loop: in a thread of its own, beside the tests' loop.
        await asyncio.to_thread(main, ["restore", str(path), "--data-dir", str(data_dir)])
    err = capsys.readouterr().err
    assert stop.value.code == 1, err
    assert err.startswith(f"kbmesh restore: {path}: "), err
    assert fragment in err, err
    assert not data_dir.exists()


# --- 3. restore trusts nothing it did not check, and only what it was asked to ------------


@pytest.mark.parametrize("size_fixed", [False, True], ids=["as-appended", "size-fixed"])
async def test_a_key_planted_in_the_key_table_is_refused_by_its_checksum(
    source: Source, tmp_path: Path, size_fixed: bool
) -> None:
    """A line appended to the key table (an admin key whose secret the attacker knows), the
    manifest left as it was or its size for the table fixed: the archive is refused, nothing
    is restored."""
    planted = new_key()
    record = ApiKey(key_hash=hash_key(planted), org_id=source.org, name="planted")
    row = json.dumps({"key": record.key_hash, "value": record.model_dump_json()})
    members = appended_line(members_of(source.archive), "kv/keys", row)
    found = manifest(members)
    for entry in found.get("members", []):
        if entry["name"].startswith("kv/keys") and size_fixed:
            entry["size"] = len(members[first(members, "kv/keys")][1])
    path = write_archive(tmp_path / "planted.tar.gz", with_manifest(members, found))
    expected = "does not match its checksum" if size_fixed else r"is \d+ bytes; its manifest says"
    with pytest.raises(BackupError, match=r"kv/keys/\S+ " + expected):
        await restore(path, tmp_path / "d")
    assert not (tmp_path / "d").exists()


async def test_without_with_keys_no_key_or_prompt_comes_back_and_restore_says_so(
    source: Source, tmp_path: Path, embedders
) -> None:
    """`kbmesh restore` alone: no API key and no stored prompt is restored, the counts it
    prints are what it restored, and it says the stack is keyless. The audit trail came along
    (the key's creation included), with the restore on it."""
    data_dir = tmp_path / "d"
    rc, out, err = await kbmesh("restore", str(source.archive), "--data-dir", str(data_dir))
    assert rc == 0, (out, err)
    summary = out.splitlines()[0]
    assert "2 KBs, 1 documents," in summary and ", 0 API keys, 0 prompts," in summary, out
    assert "not restored: 1 API keys (--with-keys), 1 prompts (--with-prompts)" in out, out
    assert "the restored stack has no API key" in out, out

    async with running_stack(data_dir, embedders=embedders) as (_rt, client):
        assert (await client.get("/v1/kbs")).status_code == 200  # keyless loopback
        r = await client.get("/v1/kbs", headers={"Authorization": f"Bearer {source.token}"})
        assert r.status_code == 401, r.text
        assert (await client.get(f"/v1/prompts/{source.prompt_id}")).status_code == 404

        trail = (await client.get("/v1/audit", params={"limit": 1000})).json()["items"]
        done = {(e["kind"], e["action"], e.get("document_id") or e.get("key_id")) for e in trail}
        assert ("document", "uploaded", source.document_id) in done, trail
        assert ("key", "created", source.key_id) in done, trail
        assert ("key", "restored", source.key_id) not in done, trail
        (restored,) = [e for e in trail if e["kind"] == "backup"]
        assert restored["action"] == "restored"
        assert restored["writer"] == {
            "kind": "operator",
            "key_id": None,
            "name": "kbmesh restore",
            "subject": None,
            "email": None,
        }
        assert source.archive.name in restored["name"]
        # The old trail first, then the restore: entries stay in time order.
        uploaded = next(e for e in trail if e["document_id"] == source.document_id)
        assert trail.index(restored) > trail.index(uploaded)


async def test_keys_restored_with_with_keys_work_and_each_is_audited(
    source: Source, tmp_path: Path, embedders
) -> None:
    """`--with-keys --with-prompts`: the key opens the restored stack, the prompt is there,
    and the trail shows the key's creation on the old stack and its restore on this one."""
    data_dir = tmp_path / "d"
    report = await restore(source.archive, data_dir, with_keys=True, with_prompts=True)
    assert report.counts["keys"] == 1 and report.counts["prompts"] == 1, report
    assert report.left_out == {}, report

    async with running_stack(data_dir, embedders=embedders) as (_rt, client):
        assert (await client.get("/v1/kbs")).status_code == 401
        client.headers["Authorization"] = f"Bearer {source.token}"
        assert (await client.get(f"/v1/kbs/{source.kb_id}")).status_code == 200
        assert (await client.get(f"/v1/prompts/{source.prompt_id}")).status_code == 200
        r = await client.get("/v1/audit", params={"kind": "key"})
        entries = [e for e in r.json()["items"] if e["key_id"] == source.key_id]
        assert [(e["action"], e["writer"]["name"]) for e in entries] == [
            ("created", "kbmesh keys"),
            ("restored", "kbmesh restore"),
        ], entries
        assert entries[1]["name"] == "admin"


# --- 4. backup writes only files it created -----------------------------------------------


async def test_backup_never_writes_through_a_link_planted_where_it_writes(
    tmp_path: Path, embedders
) -> None:
    """`kbmesh backup` with links planted at the archive's old temporary name and at the
    archive's own name: their targets keep their content and mode; the archive is a new
    regular file, 0600."""
    folder = tmp_path / "out"
    folder.mkdir()
    victims = {}
    for name in ("partial-victim", "final-victim"):
        victims[name] = tmp_path / name
        victims[name].write_text("precious")
        victims[name].chmod(0o644)
    archive = folder / "stack.tar.gz"
    (folder / f".{archive.name}.partial").symlink_to(victims["partial-victim"])
    archive.symlink_to(victims["final-victim"])

    async with running_stack(tmp_path / "a", embedders=embedders) as (rt, client):
        await create_kb(client)
        # `kbmesh backup` as an operator runs it against a stack: its NATS URL and user.
        rc, out, err = await kbmesh("backup", str(archive), env=bus_env(rt, "operator"))

    for victim in victims.values():
        assert victim.read_text() == "precious"
        assert victim.stat().st_mode & 0o777 == 0o644
    assert rc == 0, (out, err)
    assert out.startswith(f"wrote {archive}: 2 KBs,"), out
    assert not archive.is_symlink()
    assert archive.stat().st_mode & 0o777 == 0o600
    assert manifest(members_of(archive))["counts"]["kbs"] == 2  # the default KB and ours
    # Nothing of the backup's own is left beside the archive.
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [archive.name, f".{archive.name}.partial"]
    )
    assert os.readlink(folder / f".{archive.name}.partial") == str(victims["partial-victim"])
