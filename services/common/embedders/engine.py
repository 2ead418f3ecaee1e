"""The engines that run a local model: onnxruntime, which serves on CPU, and torch
(sentence-transformers), which serves on a CUDA GPU and is the fp32 reference the ONNX path
is tested and measured against. Either takes any sentence-transformers directory of a
BERT-family encoder: shapes come from its config, pooling from its pooling module.

Importable without the rest of kbmesh (numpy, tokenizers and the engine alone), so the GPU
check in benchmarks/ runs on a machine that has only those."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from services.common.embedders.base import normalise
from services.common.embedders.cpu import usable_physical_cores
from services.common.embedders.tokenizing import model_tokenizer

Pooling = Literal["mean", "cls"]


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


class Encoder(Protocol):
    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        """Unit-length float32 rows, one per text, in order."""


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
    """sentence-transformers on torch in fp32: on a CUDA device where one serves, and the
    reference on CPU (`KBMESH_LOCAL_BACKEND=torch`, tests, benchmarks)."""

    def __init__(
        self,
        model_dir: Path,
        batch_size: int = 32,
        *,
        device: Literal["cpu", "cuda"] = "cpu",
    ) -> None:
        from sentence_transformers import SentenceTransformer

        self.config = ModelConfig.read(model_dir)
        self._st = SentenceTransformer(str(model_dir), device=device, local_files_only=True)
        self._batch_size = batch_size
        # One forward at a time: on CPU it already uses every core, on a GPU one stream.
        self._lock = threading.Lock()

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        with self._lock:
            vectors = self._st.encode(
                texts,
                batch_size=self._batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return normalise(np.asarray(vectors, dtype=np.float32))
