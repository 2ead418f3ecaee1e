"""No search reply exceeds the bus's message limit: on a nats-server whose `max_payload` is
small, a search whose hits would not fit answers with shortened hits and `truncated: true`
instead of timing out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import running_stack
from tests.support.bus import nats_with_max_payload
from tests.support.domain import create_kb

MAX_PAYLOAD = 64 * 1024


@pytest.fixture
def small_nats(tmp_path: Path) -> Iterator[str]:
    with nats_with_max_payload(tmp_path, MAX_PAYLOAD) as url:
        yield url


async def test_a_reply_larger_than_max_payload_is_truncated_not_lost(
    tmp_path: Path, embedders, small_nats: str
) -> None:
    """Twelve documents of 24,000 characters without a separator (each chunked into pieces
    of at most 3,200 characters): 50 hits weigh ~160 KB, over the server's 64 KiB. Hybrid
    and dense search answer 200 at once, under the limit, with `truncated: true`, the
    best-ranked hits kept, each cut content ending in ' …'. A small search is untouched."""
    async with running_stack(tmp_path / "data", nats_url=small_nats, embedders=embedders) as (
        _,
        client,
    ):
        kb = await create_kb(client)
        for i in range(12):
            r = await client.post(
                f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
                json={"name": f"run-{i}.txt", "content": chr(ord("a") + i) * 24_000},
            )
            assert r.json()["status"] == "complete", r.text
        for mode in ("hybrid", "dense"):
            r = await client.post(
                "/v1/search",
                json={"query": "aaaa bbbb", "kb_ids": [kb["kb_id"]], "top_k": 50, "mode": mode},
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["truncated"] is True, mode
            assert len(r.content) < MAX_PAYLOAD
            hits = body["hits"]
            ranks = sorted(h["rank"] for h in hits if h["is_matched"])
            assert ranks == list(range(1, len(ranks) + 1)) and ranks
            assert all(h["content"].endswith(" …") for h in hits)
        r = await client.post(
            "/v1/search", json={"query": "aaaa", "kb_ids": [kb["kb_id"]], "top_k": 2}
        )
        assert r.json()["truncated"] is False
        assert all(len(h["content"]) > 1000 for h in r.json()["hits"])
