"""Where the time of one search goes: each hop of a REST hybrid search measured against the
same queries, interleaved query by query, on a running `kbmesh up`.

    .venv/bin/python -m benchmarks.query_path [--docs 40] [--queries 200] [--blocks]

Per query, in turn: REST hybrid, REST keyword (no query embedding), the same two as NATS
requests straight to `search.query` (no HTTP, no gateway), and the query encode alone in
this process on onnxruntime's query lane and on torch fp32 sentence-transformers. Each query
text is used once per variant with a distinct suffix, so the query cache never answers.

REST requests go over one kept-alive connection of the standard library's `http.client`,
which costs the client little; `rest_hybrid_httpx` sends the same hybrid search from an
`httpx.AsyncClient`, whose own work in this process adds about 1.6 ms to each request here.

Interleaved, every measurement follows other work or an idle pause, and on these machines
work that follows an idle pause runs about 1.5 times slower for its first milliseconds.
`--blocks` measures each variant back to back instead (all its queries in a row, after a
warm-up of its own): the steady state of a busy service.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import http.client
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import nats

from benchmarks.common import kbmesh_up_at, pct, stdlib_documents
from services.common.bus.auth import inbox_prefix, recorded_credentials
from services.common.embedders import LocalEmbedder
from services.common.messages.names import Subject
from services.common.messages.queries import SearchRequest

MODEL = "local/all-MiniLM-L6-v2"


def queries_from(docs: list[tuple[str, str]], count: int) -> list[str]:
    lines = [
        line.strip()
        for _, text in docs
        for line in text.splitlines()
        if 30 < len(line.strip()) < 80 and not line.strip().startswith(("|", "-", "="))
    ]
    return lines[:: max(1, len(lines) // count)][:count]


async def run(
    base: str, data: Path, kb_id: str, queries: list[str], blocks: bool
) -> dict[str, list[float]]:
    onnx = LocalEmbedder(MODEL, backend="onnx")
    onnx.load()
    torch = LocalEmbedder(MODEL, backend="torch", device="cpu")
    torch.load()
    # Search requests as the gateway sends them: as its NATS user, replies in its inbox.
    gateway = recorded_credentials(data, "gateway")
    if gateway is None:
        raise RuntimeError(f"no NATS credentials in {data}: start `kbmesh up` on it first")
    nc = await nats.connect(
        (data / "nats.url").read_text().strip(),
        user=gateway.user,
        password=gateway.password,
        inbox_prefix=inbox_prefix(gateway.user),
    )
    names = ("rest_hybrid", "rest_keyword", "nats_hybrid", "nats_keyword", "onnx", "torch")
    times: dict[str, list[float]] = {k: [] for k in (*names, "torch_1_thread", "rest_hybrid_httpx")}
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:

        def rest(query: str, mode: str) -> float:
            body = json.dumps({"query": query, "kb_ids": [kb_id], "top_k": 10, "mode": mode})
            headers = {"content-type": "application/json"}
            started = time.perf_counter()
            connection.request("POST", "/v1/search", body, headers)
            response = connection.getresponse()
            answer = response.read()
            elapsed = time.perf_counter() - started
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {answer[:300]!r}")
            return elapsed

        async def rest_httpx(query: str, mode: str) -> float:
            body = {"query": query, "kb_ids": [kb_id], "top_k": 10, "mode": mode}
            started = time.perf_counter()
            r = await client.post("/v1/search", json=body)
            elapsed = time.perf_counter() - started
            r.raise_for_status()
            return elapsed

        async def bus(query: str, mode: str) -> float:
            req = SearchRequest(query=query, kb_ids=[kb_id], top_k=10, mode=mode, org_id="local")
            started = time.perf_counter()
            reply = await nc.request(Subject.SEARCH_QUERY, req.model_dump_json().encode(), 30)
            elapsed = time.perf_counter() - started
            if b'"error"' in reply.data[:20]:
                raise RuntimeError(reply.data[:300])
            return elapsed

        def encode(embedder: LocalEmbedder, query: str) -> float:
            started = time.perf_counter()
            embedder.encode([query], query=True)
            elapsed = time.perf_counter() - started
            if not blocks:
                # torch's OpenMP threads spin for a while after an encode: let them stop
                # before the next variant is timed, or that one pays for them.
                time.sleep(0.05)
            return elapsed

        import torch as torch_module

        threads = torch_module.get_num_threads()

        def torch_encode(query: str, n: int) -> float:
            torch_module.set_num_threads(n)
            try:
                return encode(torch, query)
            finally:
                torch_module.set_num_threads(threads)

        def variants_of(i: int, q: str) -> list[tuple[str, Callable[[], Any]]]:
            return [
                ("rest_hybrid", lambda: rest(f"{q} r{i}", "hybrid")),
                ("nats_hybrid", lambda: bus(f"{q} n{i}", "hybrid")),
                ("rest_keyword", lambda: rest(f"{q} k{i}", "keyword")),
                ("nats_keyword", lambda: bus(f"{q} b{i}", "keyword")),
                ("onnx", lambda: encode(onnx, f"{q} o{i}")),
                ("torch", lambda: torch_encode(f"{q} t{i}", threads)),
                ("torch_1_thread", lambda: torch_encode(f"{q} s{i}", 1)),
                ("rest_hybrid_httpx", lambda: rest_httpx(f"{q} h{i}", "hybrid")),
            ]

        async def measure(call: Callable[[], Any]) -> float:
            result = call()
            return float(await result if asyncio.iscoroutine(result) else result)

        warmup = min(50 if blocks else 5, len(queries))  # the first rounds are not counted
        rounds = list(enumerate(queries[:warmup] + queries))
        if blocks:
            for v in range(len(variants_of(0, ""))):
                for i, q in rounds:
                    name, call = variants_of(i, q)[v]
                    elapsed = await measure(call)
                    if i >= warmup:
                        times[name].append(elapsed)
        else:
            for i, q in rounds:
                variants = variants_of(i, q)
                # A different variant goes first each time, so none always follows the same.
                shift = i % len(variants)
                for name, call in variants[shift:] + variants[:shift]:
                    elapsed = await measure(call)
                    if i >= warmup:
                        times[name].append(elapsed)
    await nc.close()
    connection.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=40)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--blocks", action="store_true", help="each variant back to back")
    args = parser.parse_args()
    docs = stdlib_documents(args.docs)
    queries = queries_from(docs, args.queries)
    with tempfile.TemporaryDirectory() as tmp, kbmesh_up_at(Path(tmp)) as base:
        r = httpx.post(f"{base}/v1/kbs", json={"name": "hops"})
        kb_id = r.json()["kb_id"]
        for name, text in docs:
            httpx.post(
                f"{base}/v1/kbs/{kb_id}/documents",
                json={"name": name, "content": text},
                timeout=60,
            ).raise_for_status()
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            stats = httpx.get(f"{base}/v1/kbs/{kb_id}/stats").json()
            if stats["document_count"] >= len(docs):
                break
            time.sleep(0.5)
        times = asyncio.run(run(base, Path(tmp), kb_id, queries, args.blocks))
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print(f"date {datetime.date.today()}  documents {len(docs)}  chunks {stats['chunk_count']}")
    order = "back to back" if args.blocks else "interleaved"
    print(f"queries {len(times['onnx'])} per variant, {order}\n")
    print("| measured | p50 ms | p90 ms |\n| --- | --- | --- |")
    for k, v in times.items():
        print(f"| {k} | {med[k]:.2f} | {pct(v, 0.9):.2f} |")
    hops = [
        ("HTTP + auth + gateway (REST − NATS, hybrid)", med["rest_hybrid"] - med["nats_hybrid"]),
        ("NATS + search service + engine + score lookups (NATS keyword)", med["nats_keyword"]),
        (
            "query embedding in the service (NATS hybrid − keyword)",
            med["nats_hybrid"] - med["nats_keyword"],
        ),
    ]
    print("\n| hop (difference of medians) | ms |\n| --- | --- |")
    for name, ms in hops:
        print(f"| {name} | {ms:.2f} |")
    print(
        f"\nREST hybrid p50 / torch fp32 query encode p50: {med['rest_hybrid'] / med['torch']:.2f}"
    )
    print(
        "REST hybrid p50 / torch fp32 1-thread query encode p50: "
        f"{med['rest_hybrid'] / med['torch_1_thread']:.2f}"
    )
    print(
        "REST hybrid from httpx p50 / torch fp32 query encode p50: "
        f"{med['rest_hybrid_httpx'] / med['torch']:.2f}"
    )
    print(f"onnx query encode / torch query encode: {med['onnx'] / med['torch']:.2f}")


if __name__ == "__main__":
    main()
