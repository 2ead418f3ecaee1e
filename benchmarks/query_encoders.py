"""One short query at a time on the query lane's onnxruntime session: the fp32 graph against
`w8` (8-bit weights, int8 products), and which one `auto` picks on this CPU: the figures
behind `query_variant`.

    .venv/bin/python -m benchmarks.query_encoders [--queries 200] [--rounds 2]

Each graph embeds the same queries one by one (the man200 NAME lines if built, else lines of
stdlib pydoc pages), in two conditions: back to back, and after reading 64 MB between two
queries, as a server's other work evicts the weights from the caches between searches. The
graphs take turns condition by condition and round by round, so the machine's drift falls on
both. Cosine is to the fp32 graph's vectors of the same queries.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import numpy as np

from benchmarks.common import ROOT, stdlib_documents
from benchmarks.query_path import queries_from
from services.common.embedders import LocalEmbedder
from services.common.embedders.local import (
    INT8_FLAGS,
    OnnxEncoder,
    cpu_flags,
    default_cache_dir,
    local_spec,
    query_variant,
)
from services.common.embedders.onnx_export import Variant, ensure_onnx

MODEL = "local/all-MiniLM-L6-v2"
MAN200 = ROOT / "benchmarks" / "data" / "man200" / "queries.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    if MAN200.exists():
        lines = MAN200.read_text().splitlines()
        queries = [json.loads(line)["text"] for line in lines][: args.queries]
    else:
        queries = queries_from(stdlib_documents(20), args.queries)
    embedder = LocalEmbedder(MODEL)
    spec = local_spec(embedder.name)
    variants: tuple[Variant, ...] = ("fp32", "w8")
    graphs = {
        v: OnnxEncoder(
            ensure_onnx(embedder.model_dir, default_cache_dir(), name=embedder.name, variant=v),
            embedder.model_dir,
            spec,
            32,
            lanes="queries",
        )
        for v in variants
    }
    reference = graphs["fp32"].encode(queries, query=True)
    cosine = {
        v: float(np.min(np.sum(g.encode(queries, query=True) * reference, axis=1)))
        for v, g in graphs.items()
    }
    other_work = np.ones(64 * 2**20 // 8)
    conditions = ("back to back", "after 64 MB read")
    times: dict[tuple[Variant, str], list[float]] = {}
    for r in range(args.rounds):
        for condition in conditions:
            for v, graph in graphs.items():
                run = []
                for q in queries:
                    if condition != "back to back":
                        other_work.sum()
                    started = time.perf_counter()
                    graph.encode([f"{q} {r}"], query=True)
                    run.append(time.perf_counter() - started)
                times.setdefault((v, condition), []).append(statistics.median(run) * 1000)

    flags = sorted(INT8_FLAGS & cpu_flags())
    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  queries {len(queries)}")
    print(f"int8 flags: {', '.join(flags) or 'none'}  ->  `auto` embeds queries with the ", end="")
    print(f"{query_variant()} graph")
    print(f"\n| graph | min cosine to fp32 | {' | '.join(f'p50 ms, {c}' for c in conditions)} |")
    print("| --- | --- |" + " --- |" * len(conditions))
    for v in variants:
        cells = [", ".join(f"{t:.2f}" for t in times[(v, c)]) for c in conditions]
        print(f"| {v} | {cosine[v]:.5f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
