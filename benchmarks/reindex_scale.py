"""A reindex of a large KB on the default stack: time to finish, searches meanwhile, cancel.

    python -m benchmarks.reindex_scale [--docs 2000] [--chunk-size 400] [--to 200]
        [--poll SECONDS] [--data-dir DIR] [--json FILE]

One `kbmesh up` (embedded NATS and Qdrant Edge, every default). The KB embeds with a LiteLLM
model (`openai/bench-embed`, 384 dimensions) served by the small OpenAI-compatible server of
`tests/support/openai_embeddings.py` in its own process: vectors derived from each text's
hash, answered in about a millisecond a batch (checked and printed first), so the figures
measure kbmesh's own pipeline (re-chunking the stored text, the embedding calls, upserts,
the index build), not a model. The local model cannot re-embed a KB this size in a
benchmark's time; a hosted model adds its own latency and rate limits on top.

1. `--docs` real documents (stdlib pydoc pages, each copy's paragraphs marked with its copy
   number so that no two chunks share a text) are uploaded through REST with
   `chunk_size=--chunk-size`.
2. Idle: one client searches the KB back to back (REST hybrid, top 10, distinct texts).
3. `PATCH chunk_size=--to`: the KB re-chunks every document from its stored text into a
   new collection while the old one answers; the same client searches throughout. Reported:
   time until the KB serves the new collection, chunks/s, search p50 / p99 during it.
4. A second change (back to `--chunk-size`) is cancelled once about a third of the
   documents are rebuilt: time for the cancel to answer and for the half-built collection
   to leave the disk, and whether fixed probe searches answer exactly as before it
   throughout (they would not if anything half-built were searched).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import ROOT, kbmesh_up_at, pct, stdlib_documents
from benchmarks.scale import machine

KB = "reindexed"
MODEL = "openai/bench-embed"
DIM = 384  # the bundled model's dimension: the index build costs what it does for a local KB


def disk(path: Path) -> int:
    """Bytes allocated on disk (the engine's files are sparse: their size overstates it)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def documents(n_docs: int) -> list[dict[str, str]]:
    """`n_docs` documents cycling through the stdlib pages; copy r of a page has each
    paragraph prefixed with `[r.p]`, so its chunks' texts (and vectors) are its own."""
    pages = stdlib_documents(50)
    out = []
    for i in range(n_docs):
        title, text = pages[i % len(pages)]
        copy = i // len(pages)
        marked = "\n\n".join(f"[{copy}.{p}] {para}" for p, para in enumerate(text.split("\n\n")))
        out.append({"_id": f"{copy}-{title}", "text": marked})
    return out


def queries() -> list[str]:
    return [
        line.strip()
        for _, text in stdlib_documents(50)
        for line in text.splitlines()
        if 30 < len(line.strip()) < 90
    ]


class Provider:
    """The stand-in embeddings API in its own process, so it takes no time from this one's
    searches; its base URL once listening."""

    def __init__(self) -> None:
        script = (
            "import sys, time\n"
            "from tests.support.openai_embeddings import OpenAIEmbeddingsServer\n"
            f"server = OpenAIEmbeddingsServer(dim={DIM}).start()\n"
            "print(server.base_url, flush=True)\n"
            "sys.stdin.read()\n"  # until this process closes the pipe
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.base_url = self.proc.stdout.readline().strip()
        if not self.base_url:
            raise RuntimeError("the embeddings server did not start")

    def latency(self, batch: int, rounds: int = 30) -> tuple[float, float]:
        """p50 and p99 ms of one request of `batch` texts of about a chunk's length."""
        times = []
        with httpx.Client(timeout=30) as client:
            for r in range(rounds):
                texts = [f"{r}.{i} " + "lorem ipsum dolor sit amet " * 30 for i in range(batch)]
                started = time.perf_counter()
                client.post(
                    f"{self.base_url}/embeddings", json={"model": "bench-embed", "input": texts}
                ).raise_for_status()
                times.append(time.perf_counter() - started)
        return statistics.median(times) * 1000, pct(times, 0.99)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Searcher(threading.Thread):
    """One client searching the KB back to back (hybrid, top 10, each text distinct so no
    query vector comes from the cache); latencies go to the phase now set."""

    def __init__(self, base: str, kb_id: str, texts: list[str]) -> None:
        super().__init__(daemon=True)
        self.base, self.kb_id, self.texts = base, kb_id, texts
        self.phases: dict[str, list[float]] = {}
        self.phase = ""
        self.errors: list[str] = []
        self.empty = 0
        self.halt = threading.Event()

    def run(self) -> None:
        n = 0
        with httpx.Client(base_url=self.base, timeout=60) as client:
            while not self.halt.is_set():
                text = f"{self.texts[n % len(self.texts)]} {n}"
                n += 1
                body = {"query": text, "kb_ids": [self.kb_id], "top_k": 10, "mode": "hybrid"}
                phase = self.phase
                started = time.perf_counter()
                r = client.post("/v1/search", json=body)
                took = time.perf_counter() - started
                if r.status_code != 200:
                    self.errors.append(f"{r.status_code} {r.text[:200]}")
                    continue
                if not r.json()["hits"]:
                    self.empty += 1
                if phase and phase == self.phase:  # not straddling a change of phase
                    self.phases.setdefault(phase, []).append(took)


def summary(times: list[float]) -> dict[str, float]:
    return {
        "n": len(times),
        "p50_ms": statistics.median(times) * 1000,
        "p99_ms": pct(times, 0.99),
        "max_ms": max(times) * 1000,
    }


def probe(client: httpx.Client, kb_id: str, texts: list[str]) -> list[list[str]]:
    """The chunks (id and text) each fixed probe text finds, in keyword mode: the same
    for one collection, different for another chunking."""
    found = []
    for text in texts:
        body = {"query": text, "kb_ids": [kb_id], "top_k": 10, "mode": "keyword"}
        r = client.post("/v1/search", json=body)
        r.raise_for_status()
        found.append([f"{h['chunk_id']} {h['content']}" for h in r.json()["hits"]])
    return found


def wait_for(what: str, check: Any, timeout: float, interval: float = 0.5) -> float:
    started = time.perf_counter()
    while not check():
        if time.perf_counter() - started > timeout:
            raise TimeoutError(what)
        time.sleep(interval)
    return time.perf_counter() - started


def run(args: argparse.Namespace, data: Path) -> dict[str, Any]:
    provider = Provider()
    try:
        for batch in (1, 64):
            p50, p99 = provider.latency(batch)
            print(
                f"stand-in embeddings API, {batch} texts a request: p50 {p50:.1f} ms, "
                f"p99 {p99:.1f} ms",
                flush=True,
            )
        env = {
            "KBMESH_EGRESS__ALLOW_PRIVATE": "true",
            "OPENAI_API_KEY": "bench",
            # The default wait, not the benchmarks' 900 s: before a finished wait dropped its
            # watch consumer at once, each one stayed that long, and a thousand uploads
            # within it reached NATS's consumer limit (500s); kept for comparable runs.
            "KBMESH_WAIT_TIMEOUT_SECONDS": "120",
        }
        with kbmesh_up_at(data, **env) as base:
            return measure(args, base, provider, data)
    finally:
        provider.close()


def measure(args: argparse.Namespace, base: str, provider: Provider, data: Path) -> dict:
    import asyncio

    from benchmarks.common import kbmesh_ingest

    client = httpx.Client(base_url=base, timeout=120)
    r = client.post(
        "/v1/kbs",
        json={
            "name": KB,
            "embedding_model": MODEL,
            "api_base": provider.base_url,
            "chunk_size": args.chunk_size,
        },
    )
    r.raise_for_status()
    kb_id = r.json()["kb_id"]

    async def ingest() -> tuple:
        async with httpx.AsyncClient(base_url=base, timeout=1200) as ac:
            return await kbmesh_ingest(ac, kb_id, documents(args.docs))

    took, _, stats = asyncio.run(ingest())
    chunks0 = stats["chunk_count"]
    print(
        f"ingested {stats['document_count']} documents, {chunks0} chunks "
        f"(chunk_size {args.chunk_size}) in {took:.0f} s: {chunks0 / took:.0f} chunks/s",
        flush=True,
    )
    result: dict[str, Any] = {
        "documents": stats["document_count"],
        "ingest": {"chunk_size": args.chunk_size, "chunks": chunks0, "seconds": took},
    }
    texts = queries()
    probes = texts[:: max(1, len(texts) // 20)][:20]
    searcher = Searcher(base, kb_id, texts)
    searcher.phase = "warm-up"
    searcher.start()
    time.sleep(0)  # the searcher runs from here on; phases below are timed by conditions
    wait_for("warm-up", lambda: len(searcher.phases.get("warm-up", [])) >= 100, 600, 0.2)
    searcher.phase = "idle"
    wait_for("idle", lambda: len(searcher.phases.get("idle", [])) >= args.idle, 900, 0.2)
    searcher.phase = ""
    before = probe(client, kb_id, probes)

    def kb() -> dict:
        return client.get(f"/v1/kbs/{kb_id}").json()

    # The measured reindex: a chunking change rebuilds every document into a new collection.
    searcher.phase = "reindex"
    started = time.perf_counter()
    client.patch(f"/v1/kbs/{kb_id}", json={"chunk_size": args.to}).raise_for_status()
    stale_during = 0
    while kb()["status"] != "active":  # every document's index entry at the new settings
        stale_during += probe(client, kb_id, probes[:2]) != before[:2]
        time.sleep(args.poll)
    rebuilt = time.perf_counter() - started
    # Searches move to the new collection a moment later, when embed's next check finds it
    # complete and drops the old one: the end of the reindex.
    shards = data / "shards"
    wait_for("the switch", lambda: not (shards / f"kb_{kb_id}").exists(), 600, 0.2)
    finished = time.perf_counter() - started
    searcher.phase = ""
    stats = client.get(f"/v1/kbs/{kb_id}/stats").json()
    chunks1 = stats["chunk_count"]
    after = probe(client, kb_id, probes)
    print(
        f"reindex chunk_size {args.chunk_size} -> {args.to}: {stats['document_count']} "
        f"documents, {chunks1} chunks in {finished:.0f} s: {chunks1 / finished:.0f} chunks/s; "
        f"probes changed mid-reindex {stale_during} times, after it "
        f"{'changed' if after != before else 'UNCHANGED'}",
        flush=True,
    )
    result["reindex"] = {
        "chunk_size": args.to,
        "chunks": chunks1,
        "seconds": finished,
        "all_entries_rebuilt_s": rebuilt,
        "chunks_per_s": chunks1 / finished,
        "probes_changed_mid_reindex": stale_during,
        "probes_changed_after": after != before,
    }

    # Cancel: the same change back, abandoned once about a third is rebuilt.
    serving = kb()
    searcher.phase = "cancelled reindex"
    existing = {d.name for d in shards.iterdir()}
    client.patch(f"/v1/kbs/{kb_id}", json={"chunk_size": args.chunk_size}).raise_for_status()

    def third() -> bool:
        progress = client.get(f"/v1/kbs/{kb_id}/stats").json()["progress"]["reindex"]
        return progress is not None and progress["done"] >= progress["total"] / 3

    wait_for("a third rebuilt", third, 1800, 2)
    mid = probe(client, kb_id, probes)
    new = sorted({d.name for d in shards.iterdir()} - existing)
    building = new[0] if new else None
    built_bytes = disk(shards / building) if building else None
    started = time.perf_counter()
    r = client.post(f"/v1/kbs/{kb_id}/reindex/cancel")
    answered = time.perf_counter() - started
    r.raise_for_status()
    searcher.phase = "after cancel"
    dropped = None
    if building:
        dropped = (
            wait_for(
                "the half-built collection dropped", lambda: not (shards / building).exists(), 300
            )
            + answered
        )
    settled = [probe(client, kb_id, probes) for _ in range(5)]
    wait_for(
        "after-cancel searches",
        lambda: len(searcher.phases.get("after cancel", [])) >= 200,
        600,
        0.2,
    )
    searcher.halt.set()
    searcher.join(timeout=120)
    final = kb()
    stats = client.get(f"/v1/kbs/{kb_id}/stats").json()
    result["cancel"] = {
        "answered_s": answered,
        "dropped_s": dropped,
        "half_built_collection": building,
        "half_built_bytes": built_bytes,
        "probes_same_mid_rebuild": mid == after,
        "probes_same_after_cancel": all(s == after for s in settled),
        "chunk_size_after": final["chunk_size"],
        "status_after": final["status"],
        "chunks_after": stats["chunk_count"],
        "serving_before": {k: serving.get(k) for k in ("chunk_size", "status")},
    }
    result["search"] = {phase: summary(t) for phase, t in searcher.phases.items()}
    result["search_errors"] = searcher.errors[:5]
    result["search_empty"] = searcher.empty
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--chunk-size", type=int, default=400, help="tokens, at ingest")
    parser.add_argument("--to", type=int, default=200, help="chunk_size the reindex builds")
    parser.add_argument("--idle", type=int, default=300, help="idle searches measured")
    parser.add_argument(
        "--poll",
        type=float,
        default=1.0,
        help="seconds between status reads during the reindex (each reads the KB's registries)",
    )
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, args.data_dir or Path(tmp))
    result["date"] = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    result["machine"] = machine()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print("| phase | searches | p50 ms | p99 ms | max ms |\n| --- | --- | --- | --- | --- |")
    for phase, m in result["search"].items():
        print(f"| {phase} | {m['n']} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | {m['max_ms']:.1f} |")


if __name__ == "__main__":
    main()
