"""BERT on CPUs with AMX in a small C library (`amx.c`), built once with the system's C
compiler: self-attention on AMX tiles and layer norm for the bfloat16 document encoder,
and a whole encoder for single queries (`AmxQueryEncoder`).

After the dense blocks were fused (fused.py), torch's attention for CPU (its flash kernel)
was the largest part of a bfloat16 encode left: 37 % on a Xeon with AMX, at about a tenth
of the bfloat16 peak, because a head of 32 dimensions makes each of its blocked products
tiny. The kernel computes a text's scores for one head in AMX tiles, the softmax in fp32
over the text's real keys only (padding is skipped, not masked), and the weighted values in
tiles again. torch's layer norm on bfloat16 took another 10 %; the kernel's runs in place on
the fused multiply's output. Both round as torch does (docs/benchmarks.md has the figures).

A query is one short text: run op by op (torch) or graph node by node (onnxruntime), the
model spends more time between its products than in them. `AmxQueryEncoder` runs the whole
of all-MiniLM-L6-v2 in one call: the products in AMX tiles over weights packed once in
bfloat16, everything between them in fp32 (cosine to torch fp32 >= 0.99999 on the man
pages' queries, where the 8-bit onnxruntime graph gives 0.99977), 1.1-1.2 ms a query back
to back against that graph's 1.7-1.9 (docs/benchmarks.md). Its products wait on memory
more than they compute, so a helper thread on a second core takes part in each (when the
weights have left the caches between two searches: 2.2-2.5 ms instead of 3.3-3.5), with
vectors bit for bit those of one core.

The library is built into the model cache (`<cache>/native/amx-<hash>.so`) the first time
an encoder needs it, offline, and reused after. Where the CPU lacks AMX, there is no C
compiler or the build fails, nothing changes: the encoder keeps torch's kernels and the log
says why.
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
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("amx.c")
HEAD_SIZE = 32  # the attention kernel's head size (all-MiniLM-L6-v2's)
ROWS = 16  # lengths must be whole tiles of rows (the bfloat16 batches are padded to 16)
MAX_WIDTH = 4096  # the widest layer norm the kernel takes
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
        log.warning("amx_kernels_unavailable reason=build failed: %s", detail[0])
        return None
    return target


def _open(library: Path) -> ctypes.CDLL:
    """The built library, loaded into this process, which it lets use AMX's tiles."""
    lib = ctypes.CDLL(str(library))
    if lib.kb_amx_init() != 0:
        raise OSError("the kernel refused this process AMX's tile state")
    return lib


class AmxKernels:
    """The document encoder's kernels of the built library."""

    def __init__(self, library: Path) -> None:
        import torch  # here, not at the top: the server builds the library without torch

        self._torch = torch
        lib = _open(library)
        pointers = [ctypes.c_void_p]
        self._attention = lib.kb_attention
        self._attention.argtypes = pointers * 3 + [ctypes.c_int] * 3 + [ctypes.c_float]
        self._layer_norm = lib.kb_layer_norm
        self._layer_norm.argtypes = pointers * 4 + [ctypes.c_long, ctypes.c_int, ctypes.c_float]

    def _bf16(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype == self._torch.bfloat16 and tensor.is_contiguous()

    def fits_attention(self, qkv: torch.Tensor, head_size: int) -> bool:
        """Whether `attention` computes this layer's: a contiguous bfloat16 projection of
        heads of 32, lengths a multiple of 16."""
        return (
            head_size == HEAD_SIZE and qkv.dim() == 3 and qkv.shape[1] % ROWS == 0
        ) and self._bf16(qkv)

    def attention(
        self, qkv: torch.Tensor, lengths: torch.Tensor, heads: int, scale: float
    ) -> torch.Tensor:
        """Attention over `qkv` ([batch, n, 3 x heads x 32]: queries, keys, values), each
        text attending to its first `lengths[i]` keys (int32); [batch, n, heads x 32]."""
        batch, length, _ = qkv.shape
        torch = self._torch
        out = torch.empty(batch, length, heads * HEAD_SIZE, dtype=torch.bfloat16)
        status = self._attention(
            qkv.data_ptr(), out.data_ptr(), lengths.data_ptr(), batch, length, heads, scale
        )
        if status != 0:
            raise RuntimeError(f"amx attention failed ({status})")
        return out

    def fits_layer_norm(self, x: torch.Tensor, norm: torch.nn.LayerNorm) -> bool:
        """Whether `layer_norm_` computes `norm` of `x`: bfloat16 throughout, over the last
        dimension, a multiple of 16 wide."""
        width = x.shape[-1]
        return (
            norm.normalized_shape == (width,)
            and width % 16 == 0
            and width <= MAX_WIDTH
            and norm.weight is not None
            and norm.bias is not None
            and self._bf16(x)
            and self._bf16(norm.weight)
            and self._bf16(norm.bias)
        )

    def layer_norm_(self, x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
        """`norm(x)`, written over `x`."""
        width = x.shape[-1]
        status = self._layer_norm(
            x.data_ptr(),
            norm.weight.data_ptr(),
            norm.bias.data_ptr(),
            x.data_ptr(),
            x.numel() // width,
            width,
            norm.eps,
        )
        if status != 0:
            raise RuntimeError(f"amx layer norm failed ({status})")
        return x


# The shape `kb_encode_query` computes (all-MiniLM-L6-v2's), as config.json names it.
HIDDEN, LAYERS = 384, 6
QUERY_MODEL: dict[str, object] = {
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


class AmxQueryEncoder:
    """all-MiniLM-L6-v2 embedding queries in `kb_encode_query`, one text per call, on the
    calling thread; vectors mean-pooled and unit length as sentence-transformers gives."""

    kind = "amx-bf16"

    def __init__(self, library: Path, model_dir: Path, tokenizer: Tokenizer) -> None:
        from safetensors.numpy import load_file

        config = json.loads((model_dir / "config.json").read_text())
        if any(config.get(key) != value for key, value in QUERY_MODEL.items()):
            raise ValueError(f"{model_dir} is not the model kb_encode_query computes")
        lib = _open(library)
        self._encode = lib.kb_encode_query
        self._encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
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
        self._tokenizer = tokenizer

    def encode(self, texts: list[str], *, query: bool) -> np.ndarray:
        out = np.empty((len(texts), HIDDEN), dtype=np.float32)
        for row, encoding in enumerate(self._tokenizer.encode_batch(texts)):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            status = self._encode(ids.ctypes.data, len(ids), self._weights, out[row].ctypes.data)
            if status != 0:
                raise RuntimeError(f"amx query encoder failed ({status})")
        return out

    def helped_encodes(self) -> int:
        """Encodes in this process so far that had a second core (see amx.c's helper)."""
        return int(self._helped())


def load(path: Path | None) -> AmxKernels | None:
    """The library at `path` (from `build`), or None where it cannot be used here (logged)."""
    if path is None:
        return None
    try:
        return AmxKernels(path)
    except OSError as err:
        log.warning("amx_kernels_unavailable reason=%s", err)
        return None


def main() -> None:
    """`python -m services.common.embedders.amx`: compile the library beside its source, for
    an image whose runtime has no C compiler (the Dockerfile's build stage). Any x86-64
    compiler that knows AMX's intrinsics builds it; it runs only where the CPU has AMX."""
    target = SOURCE.with_name(_library_name())
    compile_library(target)
    print(target)


if __name__ == "__main__":
    main()
