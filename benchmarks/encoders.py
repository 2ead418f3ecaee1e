"""Chunks/s of each local document encoder on one thread, on the pipeline's own chunks, and
which one `auto` picks on this CPU: the figures behind `native_bf16` and amx.c.

    .venv/bin/python -m benchmarks.encoders [--docs 20] [--chunks 480] [--rounds 2] [--set DIR]

Each encoder embeds the same chunks (stdlib pydoc pages, or with `--set` the documents of a
BEIR directory such as benchmarks/data/man200, chunked and titled as a default KB does) in
batches of 32, one thread each, the encoders taking turns round by round so the machine's
drift falls on all of them. Cosine to torch fp32 is over the first 64 chunks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.common import stdlib_documents
from benchmarks.embedding_throughput import MODEL, pipeline_chunks
from services.common.embedders import LocalEmbedder, amx
from services.common.embedders.local import (
    BF16_FLAGS,
    Encoder,
    OnnxEncoder,
    TorchEncoder,
    cpu_flags,
    default_cache_dir,
    local_spec,
    native_bf16,
)
from services.common.embedders.onnx_export import Variant, ensure_onnx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20)
    parser.add_argument("--chunks", type=int, default=480)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", type=Path, help="a BEIR directory's corpus instead of stdlib")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    onnx = LocalEmbedder(MODEL, backend="onnx")
    onnx.load(documents=False)
    documents = (
        [(d["_id"], d["text"]) for d in map(json.loads, (args.set / "corpus.jsonl").open())]
        if args.set
        else stdlib_documents(args.docs)
    )
    texts = pipeline_chunks(onnx, documents)[: args.chunks]
    spec = local_spec(onnx.name)

    def onnx_encoder(quantized: bool) -> Encoder:
        name = onnx.name + ("-int8" if quantized else "")
        variant: Variant = "int8" if quantized else "fp32"
        path = ensure_onnx(onnx.model_dir, default_cache_dir(), name=name, variant=variant)
        return OnnxEncoder(path, onnx.model_dir, spec, 32, lanes="documents", document_threads=1)

    encoders: dict[str, Encoder] = {
        "torch fp32 (the reference)": TorchEncoder(onnx.model_dir, spec, 32, threads=1),
        "onnxruntime fp32": onnx_encoder(False),
        "torch bfloat16, fused, padded": TorchEncoder(
            onnx.model_dir, spec, 32, bf16=True, threads=1
        ),
        "onnxruntime int8 per channel (opt-in model id)": onnx_encoder(True),
    }
    library = amx.build(default_cache_dir(), cpu_flags())
    if library is not None:  # what `auto` runs on a CPU with AMX
        encoders["amx.c, bfloat16 products"] = amx.AmxEncoder(
            library, onnx.model_dir, spec.max_seq_length
        )
    reference = encoders["torch fp32 (the reference)"].encode(texts[:64], query=False)
    cosine = {
        name: float(np.min(np.sum(enc.encode(texts[:64], query=False) * reference, axis=1)))
        for name, enc in encoders.items()
    }
    rates: dict[str, list[float]] = {name: [] for name in encoders}
    for _ in range(args.rounds):
        for name, enc in encoders.items():
            started = time.perf_counter()
            for i in range(0, len(texts), 32):
                enc.encode(texts[i : i + 32], query=False)
            rates[name].append(len(texts) / (time.perf_counter() - started))

    flags = sorted(BF16_FLAGS & cpu_flags())
    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  chunks {len(texts)}")
    print(f"bfloat16 flags: {', '.join(flags) or 'none'}  ->  `auto` embeds documents on ", end="")
    print(
        "amx.c"
        if library is not None
        else "torch bfloat16"
        if native_bf16()
        else "onnxruntime fp32"
    )
    base = float(np.mean(rates["torch fp32 (the reference)"]))
    print("\n| encoder, one thread | chunks/s per round | vs torch fp32 | min cosine to fp32 |")
    print("| --- | --- | --- | --- |")
    for name, values in rates.items():
        runs = " / ".join(f"{v:.1f}" for v in values)
        print(f"| {name} | {runs} | {np.mean(values) / base:.2f} | {cosine[name]:.5f} |")


if __name__ == "__main__":
    main()
