"""The least time any encoder could take to embed a set on this machine, against the time
the peer's share of it would take: the model's multiply-adds for every word piece the
pipeline embeds, over the fastest matrix products this CPU runs, one process per core.

    .venv/bin/python -m benchmarks.encode_floor benchmarks/data/man200 [--measure 256]

The set is a BEIR directory (`corpus.jsonl`), as `benchmarks.peer_qdrant` reads it. kbmesh's
texts are the chunks a default KB embeds (title line included); the peer's are each
document cut at the model's 256 word pieces, as mcp-server-qdrant embeds it. Work per text
of n word pieces: 2 x layers x (n (4h^2 + 2hi) + 2 n^2 h) floating-point operations (the
projections, the feed-forward blocks, and attention's two products), no padding counted, so
the floor is below what any real batching reaches. The peak rate is measured, not taken
from a data sheet: single-threaded matrix products in bfloat16, fp32 and int8 (square,
and the feed-forward block's own shapes), run at once in one process per usable core.
`--measure N` also times the document encoder `auto` picks on N of kbmesh's texts (one
thread) and reports the share of that peak it reaches.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.embedding_throughput import MODEL, pipeline_chunks
from services.common.embedders import LocalEmbedder, default_cache_dir
from services.common.embedders.cpu import usable_cores

KINDS = ("bfloat16", "fp32", "int8")


def work(lengths: list[int], layers: int, hidden: int, inner: int) -> float:
    """Floating-point operations of the encoder over texts of these lengths."""
    per_token = 4 * hidden * hidden + 2 * hidden * inner
    return 2.0 * layers * sum(n * per_token + 2 * n * n * hidden for n in lengths)


def _rate(kind: str, hidden: int, inner: int, seconds: float, start: Any) -> float:
    """Operations/s of the fastest single-threaded product of `kind` (a worker process)."""
    import torch

    torch.set_num_threads(1)
    rows = 16 * 192  # one of the bfloat16 encoder's sub-batches of 16 chunk-length texts
    shapes = [(2048, 2048, 2048), (rows, hidden, inner), (rows, inner, hidden)]
    start.wait()  # a manager Event: every process starts its products at once
    product: Callable[[Any, Any], Any] = torch._int_mm if kind == "int8" else torch.matmul
    best = 0.0
    for m, k, n in shapes:
        if kind == "int8":
            a = torch.randint(-64, 64, (m, k), dtype=torch.int8)
            b = torch.randint(-64, 64, (k, n), dtype=torch.int8)
        else:
            dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        product(a, b)
        count, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds / len(shapes):
            product(a, b)
            count += 1
        best = max(best, 2.0 * m * k * n * count / elapsed)
    return best


def peak(kind: str, processes: int, hidden: int, inner: int, seconds: float) -> float:
    """The CPU's rate for `kind` with every usable core busy at once."""
    context = multiprocessing.get_context("spawn")
    start = context.Manager().Event()
    with context.Pool(processes) as pool:
        pending = [
            pool.apply_async(_rate, (kind, hidden, inner, seconds, start)) for _ in range(processes)
        ]
        time.sleep(2.0)  # every worker imported torch and waits
        start.set()
        return sum(p.get() for p in pending)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("set", type=Path, help="BEIR directory, e.g. benchmarks/data/man200")
    parser.add_argument("--seconds", type=float, default=6.0, help="per rate measurement")
    parser.add_argument("--measure", type=int, default=0, help="texts to time the encoder on")
    args = parser.parse_args()

    corpus = [json.loads(line) for line in (args.set / "corpus.jsonl").open()]
    embedder = LocalEmbedder(MODEL, backend="onnx")
    embedder.load(documents=False)
    config = json.loads((embedder.model_dir / "config.json").read_text())
    shape = (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"])

    from services.common.embedders.tokenizing import model_tokenizer

    tokenizer = model_tokenizer(embedder.model_dir, embedder.max_tokens + 2)
    texts = pipeline_chunks(embedder, [(d["_id"], d["text"]) for d in corpus])
    ours = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    theirs = [len(e.ids) for e in tokenizer.encode_batch([d["text"] for d in corpus])]
    cores = usable_cores()
    rates = {kind: peak(kind, cores, shape[1], shape[2], args.seconds) for kind in KINDS}

    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  set {args.set}")
    print(f"model {MODEL}: {shape[0]} layers, hidden {shape[1]}, inner {shape[2]}")
    print(f"cores {cores}: peak with all busy, one process each")
    for kind in KINDS:
        print(f"  {kind}: {rates[kind] / 1e9:.0f} G/s")
    floors = " | ".join(f"floor {kind} s" for kind in KINDS)
    print(f"\n| texts | count | word pieces | TFLOP | {floors} |")
    print("| --- | --- | --- | --- |" + " --- |" * len(KINDS))
    for label, lengths in (("kbmesh chunks", ours), ("peer: first 256 word pieces", theirs)):
        flops = work(lengths, *shape)
        floors = " | ".join(f"{flops / rates[kind]:.1f}" for kind in KINDS)
        print(f"| {label} | {len(lengths)} | {sum(lengths):,} | {flops / 1e12:.2f} | {floors} |")

    if args.measure:
        import torch

        from services.common.embedders.engine import OnnxEncoder
        from services.common.embedders.onnx_export import ensure_onnx

        torch.set_num_threads(1)
        sample = texts[: args.measure]
        graph = ensure_onnx(
            embedder.model_dir, default_cache_dir(), name=embedder.name, variant="fp32"
        )
        encoder = OnnxEncoder(graph, embedder.model_dir, lanes="documents", threads=1)
        encoder.encode(sample[:32], query=False)
        started = time.perf_counter()
        for i in range(0, len(sample), 32):
            encoder.encode(sample[i : i + 32], query=False)
        elapsed = time.perf_counter() - started
        kind = "fp32"
        achieved = work(ours[: len(sample)], *shape) / elapsed
        share = achieved / (rates[kind] / cores)
        print(
            f"\ndocument encoder (onnxruntime {kind}, one thread): "
            f"{len(sample) / elapsed:.1f} chunks/s,"
            f" {achieved / 1e9:.0f} G/s, {share:.0%} of one core's {kind} peak"
        )


if __name__ == "__main__":
    main()
