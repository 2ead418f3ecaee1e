"""The engines that run a local model: onnxruntime, which serves on CPU, and torch
(sentence-transformers), which serves on a CUDA GPU and is the fp32 reference the ONNX path
is tested and measured against. Either takes any sentence-transformers directory of a
BERT-family encoder: shapes come from its config, pooling from its pooling module.

Importable without the rest of kbmesh (numpy, tokenizers and the engine alone), so the GPU
check in benchmarks/ runs on a machine that has only those."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from services.common.embedders.base import normalise
from services.common.embedders.cpu import usable_physical_cores
from services.common.embedders.tokenizing import model_tokenizer

Pooling = Literal["mean", "cls"]

# Rows of a GPU batch of texts at the model's sequence limit: the H200 embedded 1,819
# chunks/s in fp16 at batches of 256 and 1,147/s at 32 (fp32). Shorter texts fill more rows
# (`token_batches`): what a batch costs is its padded tokens, not its count of texts.
CUDA_BATCH_ROWS = 256


def token_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Positions of texts of these token lengths, shortest first, cut into batches whose
    padded size (rows × the batch's longest) stays within `budget` tokens. Sorted, a batch
    holds texts of about one length, so little of it is padding; a text longer than the
    budget runs alone."""
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        # Ascending: the text being added is the batch's longest.
        if batch and (len(batch) + 1) * lengths[i] > budget:
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


@dataclass(frozen=True)
class ModelConfig:
    """What serving needs to know of a model directory, read from its own files."""

    dim: int
    max_seq_length: int
    layers: int
    heads: int
    pooling: Pooling

    @classmethod
    def read(cls, model_dir: Path) -> ModelConfig:
        """ValueError for a directory that is not a sentence-transformers encoder served
        here: a pooling other than mean or [CLS], or modules after the pooling that change
        vectors (a dense projection, say) beyond normalisation."""
        config = json.loads((model_dir / "config.json").read_text())
        modules = _json(model_dir / "modules.json") or []
        extra = [m["type"] for m in modules[2:] if not m["type"].endswith("Normalize")]
        if extra:
            raise ValueError(f"{model_dir}: modules after pooling are not supported: {extra}")
        pooling_dir = next((m["path"] for m in modules if m["type"].endswith("Pooling")), "")
        pooling = _json(model_dir / pooling_dir / "config.json") if pooling_dir else None
        mode: Pooling = "mean"
        if pooling and pooling.get("pooling_mode_cls_token"):
            mode = "cls"
        elif pooling and not pooling.get("pooling_mode_mean_tokens"):
            raise ValueError(f"{model_dir}: only mean or [CLS] pooling is supported")
        st_config = _json(model_dir / "sentence_bert_config.json") or {}
        return cls(
            dim=int(config["hidden_size"]),
            max_seq_length=int(
                st_config.get("max_seq_length") or config["max_position_embeddings"]
            ),
            layers=int(config["num_hidden_layers"]),
            heads=int(config["num_attention_heads"]),
            pooling=mode,
        )


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def faster_for_queries(
    document_engine_ms: Sequence[float], cpu_engine_ms: Sequence[float]
) -> Literal["documents", "cpu"]:
    """The engine that answers one short text faster, by the median of single-query timings
    (one cold or preempted run does not decide). A tie keeps the document engine: one engine
    then embeds queries and documents, bit for bit the same model. ValueError without
    timings."""
    if not document_engine_ms or not cpu_engine_ms:
        raise ValueError("faster_for_queries needs timings of both engines")
    faster = statistics.median(cpu_engine_ms) < statistics.median(document_engine_ms)
    return "cpu" if faster else "documents"


class Encoder(Protocol):
    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        """Unit-length float32 rows, one per text, in order."""


# Short queries timed at load, one at a time and interleaved, on the GPU and on the CPU's
# engine, for `faster_for_queries` (about 0.1 s on a GPU).
QUERY_PROBES = (
    "how to rotate log files",
    "list open network ports",
    "read a csv file in python",
    "restart a service after an upgrade",
    "what does permission denied mean",
)
QUERY_PROBE_ROUNDS = 3


def single_query_ms(encoders: Sequence[Encoder]) -> list[list[float]]:
    """Milliseconds of each encoder for each of `QUERY_PROBES` alone, `QUERY_PROBE_ROUNDS`
    times, the encoders taking turns so that the machine's drift falls on each alike."""
    took: list[list[float]] = [[] for _ in encoders]
    for _ in range(QUERY_PROBE_ROUNDS):
        for text in QUERY_PROBES:
            for timings, encoder in zip(took, encoders, strict=True):
                started = time.perf_counter()
                encoder.encode([text], query=True)
                timings.append(1000 * (time.perf_counter() - started))
    return took


class OnnxEncoder:
    """onnxruntime on CPU over the exported graph (onnx_export), with the model's pooling
    and normalisation applied to its last hidden state as sentence-transformers applies
    them. Texts are sorted by length and padded per sub-batch: far less padding than one
    batch padded to its longest text."""

    def __init__(
        self,
        onnx_path: Path,
        model_dir: Path,
        batch_size: int = 32,
        *,
        lanes: Literal["both", "documents", "queries"] = "both",
        threads: int = 0,
    ) -> None:
        """`lanes`: the sessions to open (one for queries, one for document batches, so a
        query never waits behind a batch). `threads`: 0 is one per usable physical core."""
        import onnxruntime as ort

        self.config = ModelConfig.read(model_dir)
        self._tok = model_tokenizer(model_dir, self.config.max_seq_length)
        self._batch_size = batch_size

        def session(*, spin: bool) -> ort.InferenceSession:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads or usable_physical_cores()
            options.inter_op_num_threads = 1
            # Queries are short: threads parking between the graph's many small parallel
            # sections slow them, so query threads spin while a run lasts and stop when it
            # ends (leaving the cores to the search). Batches are too long for waking to cost.
            options.add_session_config_entry("session.intra_op.allow_spinning", str(int(spin)))
            if spin:
                options.add_session_config_entry("session.force_spinning_stop", "1")
            return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])

        self._documents = session(spin=False) if lanes != "queries" else None
        self._queries = session(spin=True) if lanes != "documents" else self._documents
        self._documents = self._documents or self._queries
        assert self._documents is not None and self._queries is not None
        self._inputs = {i.name for i in self._documents.get_inputs()}

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        sess = self._queries if query else self._documents
        assert sess is not None
        # sentence-transformers strips inputs before tokenising.
        encodings = self._tok.encode_batch([t.strip() for t in texts])
        out = np.zeros((len(texts), self.config.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        for start in range(0, len(order), self._batch_size):
            part = order[start : start + self._batch_size]
            rows = [encodings[i].ids for i in part]
            width = max(map(len, rows))
            ids = np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int64)
            mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=np.int64)
            feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
            (hidden,) = sess.run(["last_hidden_state"], {k: feed[k] for k in self._inputs})
            if self.config.pooling == "cls":
                out[part] = hidden[:, 0]
            else:
                weights = mask[..., None].astype(np.float32)
                counts = np.clip(weights.sum(axis=1), 1e-9, None)
                out[part] = (hidden * weights).sum(axis=1) / counts
        return normalise(out)


class TorchEncoder:
    """sentence-transformers on torch: on a CUDA device where one serves (fp16 by default:
    `selection.BACKENDS`), and in fp32 the reference on CPU (`KBMESH_LOCAL_BACKEND=torch`,
    tests, benchmarks). With a `token_budget`, texts run in `token_batches` of that many
    padded tokens; without, in batches of `batch_size` texts."""

    def __init__(
        self,
        model_dir: Path,
        batch_size: int = 32,
        *,
        device: Literal["cpu", "cuda"] = "cpu",
        precision: Literal["fp32", "fp16"] = "fp32",
        token_budget: int | None = None,
    ) -> None:
        from sentence_transformers import SentenceTransformer

        self.config = ModelConfig.read(model_dir)
        self._st = SentenceTransformer(str(model_dir), device=device, local_files_only=True)
        if precision == "fp16":
            self._st.half()
        self._batch_size = batch_size
        self._budget = token_budget
        self._tok = model_tokenizer(model_dir, self.config.max_seq_length) if token_budget else None
        # One forward at a time: on CPU it already uses every core, on a GPU one stream.
        self._lock = threading.Lock()

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        if self._tok is None or self._budget is None:
            return self._encode(texts, self._batch_size)
        out = np.zeros((len(texts), self.config.dim), dtype=np.float32)
        lengths = [len(e.ids) for e in self._tok.encode_batch([t.strip() for t in texts])]
        for batch in token_batches(lengths, self._budget):
            out[batch] = self._encode([texts[i] for i in batch], len(batch))
        return out

    def _encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        with self._lock:
            vectors = self._st.encode(
                texts,
                batch_size=batch_size,
                # Normalised below in fp32, whatever precision the model ran in.
                normalize_embeddings=False,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return normalise(np.asarray(vectors, dtype=np.float32))
