"""all-MiniLM-L6-v2 on CPUs with AMX in a small C library (`amx.c`), built once with the
system's C compiler: `AmxEncoder` embeds document batches (in the children of `auto`) and
single queries (in the server), every product on AMX tiles over weights packed once in
bfloat16.

Documents. torch's bfloat16 encoder, fused (fused.py), with attention and layer norms in this
library, embedded 125-135 man-page chunks a second on one core; its dense products in oneDNN
were half of that time, their exact GELU about as long as the intermediate product itself.
`kb_encode_documents` runs the whole model in one call: the texts of a batch packed one
after another (each rounded up to 16 rows, not padded to the longest), each product in
blocks whose bias, GELU or residual and layer norm are applied while the block is in cache,
during the next block's tile steps, the residual stream in fp32. On the same chunks, one
core: 158-170 chunks a second, cosine to torch fp32 >= 0.99997 (torch bfloat16: 0.99993);
docs/benchmarks.md has the figures.

Queries. A query is one short text: run op by op (torch) or graph node by node
(onnxruntime), the model spends more time between its products than in them.
`kb_encode_query` runs the whole model for one text with everything between the products
in fp32 (cosine to torch fp32 >= 0.99999 on the man pages' queries, where the 8-bit
onnxruntime graph gives 0.99977), 1.1-1.2 ms a query back to back against that graph's
1.7-1.9. Its products wait on memory more than they compute, so a helper thread on a second
core takes part in each (when the weights have left the caches between two searches: 2.2-2.5
ms instead of 3.3-3.5), with vectors bit for bit those of one core.

The library is built into the model cache (`<cache>/native/amx-<hash>.so`) the first time
an encoder needs it, offline, and reused after. Where the CPU lacks AMX, there is no C
compiler or the build fails, nothing changes: documents run on torch bfloat16 and queries on
onnxruntime, and the log says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("amx.c")
ROWS = 16  # a text takes whole tiles of rows: its length rounded up to 16
# What the library's instructions need, as /proc/cpuinfo names them.
CPU_FLAGS = frozenset({"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
CFLAGS = (
    "-O3",
    "-shared",
    "-fPIC",
    "-pthread",
    "-mamx-tile",
    "-mamx-bf16",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512bf16",
    "-mfma",
)


def _library_name() -> str:
    key = SOURCE.read_bytes() + " ".join(CFLAGS).encode()
    return f"amx-{hashlib.sha256(key).hexdigest()[:16]}.so"


def compile_library(target: Path) -> None:
    """Compile `amx.c` into `target`, whole or not at all (a process building beside this
    one sees either nothing or the finished file). Raises `OSError` or
    `subprocess.SubprocessError` with the compiler's complaint."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        subprocess.run(
            [compiler, *CFLAGS, "-o", str(partial), str(SOURCE), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def build(cache_dir: Path, cpu_flags: set[str]) -> Path | None:
    """The library for this CPU: shipped beside the source (an image built it, see
    `main`), else in `cache_dir`, compiled there if it is not there yet. None where it
    cannot run or be built (logged)."""
    if not CPU_FLAGS.issubset(cpu_flags):
        return None
    name = _library_name()
    shipped = SOURCE.with_name(name)
    if shipped.exists():
        return shipped
    target = cache_dir / "native" / name
    if target.exists():
        return target
    try:
        compile_library(target)
    except (OSError, subprocess.SubprocessError) as err:
        stderr = getattr(err, "stderr", b"") or b""
        detail = stderr.decode(errors="replace").strip().splitlines()[-1:] or [str(err)]
        log.warning("amx_library_unavailable reason=build failed: %s", detail[0])
        return None
    return target


def _open(library: Path) -> ctypes.CDLL:
    """The built library, loaded into this process, which it lets use AMX's tiles."""
    lib = ctypes.CDLL(str(library))
    if lib.kb_amx_init() != 0:
        raise OSError("the kernel refused this process AMX's tile state")
    return lib


# The shape amx.c's encoders compute (all-MiniLM-L6-v2's), as config.json names it.
HIDDEN, LAYERS = 384, 6
MODEL: dict[str, object] = {
    "model_type": "bert",
    "hidden_size": HIDDEN,
    "num_attention_heads": 12,
    "num_hidden_layers": LAYERS,
    "intermediate_size": 1536,
    "hidden_act": "gelu",
    "max_position_embeddings": 512,
    "layer_norm_eps": 1e-12,
    "position_embedding_type": "absolute",
}


def _bf16(values: np.ndarray) -> np.ndarray:
    """fp32 to bfloat16 bits, rounded to nearest even (as torch rounds)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _tiles(weight: np.ndarray) -> np.ndarray:
    """A linear layer's weight ([outputs, inputs]) as `amx.c`'s `dense` reads it: AMX tiles
    of 16 outputs by 32 inputs, inputs paired, [outputs/16][inputs/32][16][16][2]."""
    outputs, inputs = weight.shape
    pairs = weight.T.reshape(inputs // 32, 16, 2, outputs // 16, 16)
    return _bf16(np.ascontiguousarray(pairs.transpose(3, 0, 1, 4, 2)))


# Rows of one `kb_encode_documents` call, at most (a text takes its length rounded up to 16):
# its activations, about 8 KB a row, stay a few tens of MB. 1,155 man-page chunks on one
# core, in calls of 4 to 32 texts of ~200 word pieces: 142-163 chunks/s alike, 122 in calls
# of 64 (measured before a block's GELU and layer norm moved between tile steps).
DOCUMENT_ROWS = 4096


class AmxEncoder:
    """all-MiniLM-L6-v2 on amx.c, vectors mean-pooled and unit length as sentence-transformers
    gives them: a query one text per call to `kb_encode_query` (with a second core's help),
    documents in batches through `kb_encode_documents`, on the calling thread."""

    kind = "amx-bf16"

    def __init__(self, library: Path, model_dir: Path, max_seq_length: int) -> None:
        from safetensors.numpy import load_file

        from services.common.embedders.tokenizing import model_input_tokenizer

        config = json.loads((model_dir / "config.json").read_text())
        if any(config.get(key) != value for key, value in MODEL.items()):
            raise ValueError(f"{model_dir} is not the model amx.c computes")
        lib = _open(library)
        pointer, number = ctypes.c_void_p, ctypes.c_int
        self._query = lib.kb_encode_query
        self._query.argtypes = [pointer, number, pointer, pointer]
        self._documents = lib.kb_encode_documents
        self._documents.argtypes = [pointer, pointer, number, pointer, pointer]
        self._helped = lib.kb_helped_encodes
        self._helped.restype = ctypes.c_long
        weights = load_file(str(model_dir / "model.safetensors"))

        def fp32(name: str) -> np.ndarray:
            return np.ascontiguousarray(weights[name], np.float32)

        arrays = [
            fp32("embeddings.word_embeddings.weight"),
            fp32("embeddings.position_embeddings.weight"),
            np.ascontiguousarray(weights["embeddings.token_type_embeddings.weight"][0]),
            fp32("embeddings.LayerNorm.weight"),
            fp32("embeddings.LayerNorm.bias"),
        ]
        for layer in range(LAYERS):
            name = f"encoder.layer.{layer}."
            projections = [f"{name}attention.self.{p}" for p in ("query", "key", "value")]
            arrays += [
                _tiles(np.concatenate([weights[f"{p}.weight"] for p in projections])),
                np.concatenate([fp32(f"{p}.bias") for p in projections]),
            ]
            for block in ("attention.output", "intermediate", "output"):
                arrays += [_tiles(weights[f"{name}{block}.dense.weight"])]
                arrays += [fp32(f"{name}{block}.dense.bias")]
                if block != "intermediate":
                    arrays += [fp32(f"{name}{block}.LayerNorm.weight")]
                    arrays += [fp32(f"{name}{block}.LayerNorm.bias")]
        self._arrays = arrays  # kept alive: the library reads them by address
        self._weights = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
        self._tokenizer = model_input_tokenizer(model_dir, max_seq_length)

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        out = np.empty((len(texts), HIDDEN), dtype=np.float32)
        encodings = [np.asarray(e.ids, np.int32) for e in self._tokenizer.encode_batch(texts)]
        if query:
            for row, ids in enumerate(encodings):
                status = self._query(ids.ctypes.data, len(ids), self._weights, out[row].ctypes.data)
                if status != 0:
                    raise RuntimeError(f"amx query encoder failed ({status})")
            return out
        first = rows = 0
        for last, ids in enumerate(encodings, 1):
            rows += -(-len(ids) // ROWS) * ROWS
            if rows >= DOCUMENT_ROWS or last == len(encodings):
                self._encode_documents(encodings[first:last], out[first:last])
                first, rows = last, 0
        return out

    def _encode_documents(self, encodings: list[np.ndarray], out: np.ndarray) -> None:
        ids = np.concatenate(encodings)
        lengths = np.asarray([len(e) for e in encodings], np.int32)
        status = self._documents(
            ids.ctypes.data, lengths.ctypes.data, len(lengths), self._weights, out.ctypes.data
        )
        if status != 0:
            raise RuntimeError(f"amx document encoder failed ({status})")

    def helped_encodes(self) -> int:
        """Query encodes in this process so far that had a second core (see amx.c's helper)."""
        return int(self._helped())


def main() -> None:
    """`python -m services.common.embedders.amx`: compile the library beside its source, for
    an image whose runtime has no C compiler (the Dockerfile's build stage). Any x86-64
    compiler that knows AMX's intrinsics builds it; it runs only where the CPU has AMX."""
    target = SOURCE.with_name(_library_name())
    compile_library(target)
    print(target)


if __name__ == "__main__":
    main()
