"""Search latency while another KB ingests: does a short query wait behind indexing work?

    python3 ../shared/bench/manpages.py benchmarks/data/man200 --sections 1 --max-docs 200
    .venv/bin/python -m benchmarks.search_during_ingest benchmarks/data/man200

On one `kbmesh up`: the first half of the set's documents go into KB "searched" (indexed
before anything is measured), then one client searches that KB back to back (REST hybrid,
top 10, distinct query texts so the query cache never answers): first with nothing else
running, then while the second half is uploaded into KB "loaded" (uploads with `wait=true`,
64 in flight) and indexed. Reports search p50 / p90 / p99 for both phases and the ingest time.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.common import kbmesh_ingest, kbmesh_up_at, pct


async def run(directory: Path, warmup: int) -> None:
    corpus = [json.loads(line) for line in (directory / "corpus.jsonl").open()]
    queries = [json.loads(line)["text"] for line in (directory / "queries.jsonl").open()]
    half = len(corpus) // 2
    with kbmesh_up_at(None) as base:
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:
            searched = (await client.post("/v1/kbs", json={"name": "searched"})).json()["kb_id"]
            loaded = (await client.post("/v1/kbs", json={"name": "loaded"})).json()["kb_id"]
            await kbmesh_ingest(client, searched, corpus[:half])
            round_ = 0

            async def search() -> float:
                nonlocal round_
                text = f"{queries[round_ % len(queries)]} {round_}"  # never cached
                round_ += 1
                body = {"query": text, "kb_ids": [searched], "top_k": 10}
                started = time.perf_counter()
                r = await client.post("/v1/search", json=body)
                r.raise_for_status()
                return time.perf_counter() - started

            for _ in range(warmup):
                await search()
            idle = [await search() for _ in range(len(queries))]

            busy: list[float] = []
            ingest = asyncio.create_task(kbmesh_ingest(client, loaded, corpus[half:]))
            while not ingest.done():
                busy.append(await search())
            ingest_seconds, _, _ = await ingest
    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  set {directory}")
    print(f"searched KB {half} documents; loaded KB {len(corpus) - half} documents")
    print("| phase | searches | p50 ms | p90 ms | p99 ms | max ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, times in (("idle", idle), ("during ingest", busy)):
        print(
            f"| {name} | {len(times)} | {statistics.median(times) * 1000:.1f} | "
            f"{pct(times, 0.9):.1f} | {pct(times, 0.99):.1f} | {max(times) * 1000:.1f} |"
        )
    print(f"ingest of the loaded KB while searching: {ingest_seconds:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("beir_dir", type=Path)
    parser.add_argument("--warmup", type=int, default=100, help="unmeasured searches first")
    args = parser.parse_args()
    asyncio.run(run(args.beir_dir, args.warmup))


if __name__ == "__main__":
    main()
