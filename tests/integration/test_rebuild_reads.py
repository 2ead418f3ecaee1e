"""A rebuild finds out that it is complete without reading the whole registry once per
document it indexes (which made a rebuild of N documents read N x N records)."""

from __future__ import annotations

import pytest

from tests.conftest import running_stack
from tests.support.domain import wait_until

DOCUMENTS = 40


async def test_a_rebuild_checks_its_completion_a_bounded_number_of_times(
    tmp_path, embedders, monkeypatch: pytest.MonkeyPatch
):
    """Reindexing a KB of 40 documents switches searches to the new collection, while the
    org's documents are listed a few times in all (the reindex call, the backfill, the
    completion checks), not once per document indexed."""
    async with running_stack(tmp_path, embedders=embedders) as (rt, client):
        kb_id = (await client.post("/v1/kbs", json={"name": "rebuilt"})).json()["kb_id"]
        for i in range(DOCUMENTS):
            r = await client.post(
                f"/v1/kbs/{kb_id}/documents?wait=true",
                json={"name": f"note-{i}.md", "content": f"Note {i} about volcano number {i}."},
            )
            assert r.json()["status"] == "complete", r.text
        listings = 0
        listed = rt.registries.documents.list

        async def counted(prefix: str = "", *, fresh: bool = False):
            nonlocal listings
            listings += 1
            return await listed(prefix, fresh=fresh)

        monkeypatch.setattr(rt.registries.documents, "list", counted)
        r = await client.post(f"/v1/kbs/{kb_id}/reindex")
        assert r.status_code == 202, r.text

        async def switched() -> bool:
            kb = await rt.registries.kbs.get(f"local.{kb_id}")
            return kb is not None and kb.serving is None

        await wait_until(switched, timeout=120, interval=0.2, what="the switch after reindex")
        assert await rt.store.count(f"kb_{kb_id}_g2") == DOCUMENTS
        assert listings <= 10, f"the org's documents were listed {listings} times"
        r = await client.post("/v1/search", json={"query": "volcano 7", "kb_ids": [kb_id]})
        assert r.status_code == 200 and r.json()["hits"], r.text
