"""`kbmesh backup` while a stack ingests and answers searches, and `kbmesh restore` into a new
data dir that then serves the same KBs, documents and answers."""

from __future__ import annotations

import asyncio
import tarfile
from pathlib import Path

import pytest

from services.cli.backup import BackupError, backup, check_archive, restore
from services.cli.commands import main
from tests.conftest import running_stack
from tests.support.bus import OperatorKeys, operator_bus
from tests.support.domain import create_kb, uid

FACTS = {
    f"fact-{i}.md": text
    for i, text in enumerate(
        [
            "The lighthouse keeper logs every passing ship in a leather ledger.",
            "Beekeepers smoke the hive gently before lifting the honey frames.",
            "A glacier carves a U-shaped valley as it creeps downhill over centuries.",
            "The baker folds butter into the dough six times for flaky croissants.",
            "Tidal pools hold anemones, crabs and starfish between the rocks at low tide.",
            "The cartographer drew the coastline from soundings taken by the survey boat.",
        ]
    )
}
QUERIES = {
    "fact-0.md": "who records ships in a ledger",
    "fact-2.md": "how glaciers shape valleys",
    "fact-4.md": "creatures living in rock pools at low tide",
}


async def test_a_backup_during_an_ingest_restores_into_a_stack_that_answers_the_same(
    tmp_path: Path, embedders
) -> None:
    archive = tmp_path / "stack.tar.gz"
    async with running_stack(tmp_path / "a", embedders=embedders) as (rt, client):
        kb = await create_kb(client, name=f"facts-{uid()}", tag_ids=["facts"])
        token = await OperatorKeys(rt).create("local", "restore check")
        client.headers["Authorization"] = f"Bearer {token}"
        prompt = await client.post(
            "/v1/prompts",
            json={"name": f"p-{uid()}", "model": "openai/gpt-4o-mini", "instructions": "Answer."},
        )
        assert prompt.status_code == 201, prompt.text
        # Uploads sent without waiting: the backup runs while they are extracted and
        # embedded, and while searches keep being answered.
        for name, text in FACTS.items():
            r = await client.post(
                "/v1/documents", json={"name": name, "content": text, "tags": ["facts"]}
            )
            assert r.status_code in (200, 202), r.text
        search = asyncio.create_task(
            client.post("/v1/search", json={"query": "ledger", "kb_ids": [kb["kb_id"]]})
        )
        async with operator_bus(rt) as bus:
            manifest = await backup(bus, archive)
        assert (await search).status_code == 200
        # Every upload is in the archive: as a document, or as its event still waiting.
        assert manifest.counts["documents"] + manifest.counts["events"] >= len(FACTS), manifest
        for name in FACTS:  # the source stack finishes its ingest, for the answers below
            r = await client.post(
                "/v1/documents?wait=true",
                json={"name": name, "content": FACTS[name], "tags": ["facts"]},
            )
            assert r.status_code in (200, 202), r.text
        before = {
            q: (await client.post("/v1/search", json={"query": q, "kb_ids": [kb["kb_id"]]})).json()[
                "hits"
            ][0]["document_name"]
            for q in QUERIES.values()
        }
    assert archive.stat().st_mode & 0o777 == 0o600

    await restore(archive, tmp_path / "b", with_keys=True, with_prompts=True)
    async with running_stack(tmp_path / "b", embedders=embedders) as (_rt, client):
        # The key came along: the restored stack is keyed, and knows it.
        assert (await client.get("/v1/kbs")).status_code == 401
        client.headers["Authorization"] = f"Bearer {token}"
        got = (await client.get(f"/v1/kbs/{kb['kb_id']}")).json()
        assert got["name"] == kb["name"] and got["document_count"] == len(FACTS)
        for expected, query in QUERIES.items():
            r = await client.post("/v1/search", json={"query": query, "kb_ids": [kb["kb_id"]]})
            assert r.json()["hits"][0]["document_name"] == expected == before[query]
        r = await client.get(f"/v1/prompts/{prompt.json()['prompt_id']}")
        assert r.status_code == 200, r.text


async def test_restore_refuses_a_data_dir_in_use_and_a_file_that_is_no_backup(
    tmp_path: Path,
) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "nats").mkdir()
    bogus = tmp_path / "bogus.tar.gz"
    with tarfile.open(bogus, "w:gz"):
        pass
    with pytest.raises(BackupError, match=r"manifest\.json is not its first member"):
        await restore(bogus, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "text.tar.gz").write_text("plain text")
    with pytest.raises(BackupError, match="not a kbmesh backup"):
        check_archive(tmp_path / "text.tar.gz")


def test_the_commands_say_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.tar.gz").write_text("not an archive")
    with pytest.raises(SystemExit) as stop:
        main(["restore", str(tmp_path / "x.tar.gz"), "--data-dir", str(tmp_path / "d")])
    assert stop.value.code == 1
    assert "kbmesh restore:" in capsys.readouterr().err
