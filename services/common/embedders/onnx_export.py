"""Builds the onnxruntime form of a packaged sentence-transformers model, once, into a cache.

The packaged weights are exported with torch's own exporter, fused by onnxruntime's BERT
optimiser (attention and layer-norm kernels: about 1.3× faster again on these CPUs) and,
for the `-int8` model ids, quantised per output channel (per-tensor int8 drops cosine to
torch to about 0.90; per channel keeps about 0.99). The `w8` variant keeps fp32 vectors'
directions (cosine ≥ 0.999 to torch) with 8-bit weights in blocks of 32: the query lane's
graph where the CPU multiplies int8 in hardware. Nothing is downloaded.

The export runs in a child process (`python -m services.common.embedders.onnx_export`), so a
serving process never imports torch; a file lock keeps concurrent starts from exporting twice,
and the result appears under its final name only when complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

# Bump when the recipe below changes: caches built by an older recipe are then rebuilt.
RECIPE_VERSION = 1
ONNX_FILE = "model.onnx"
_INPUTS = ["input_ids", "attention_mask", "token_type_ids"]

# fp32: the reference. int8: per-channel int8 (its own model ids). w8: fp32 with 8-bit
# weights in blocks of 32 and int8 products (see `_weights8`).
Variant = Literal["fp32", "int8", "w8"]
VARIANTS: tuple[Variant, ...] = ("fp32", "int8", "w8")


def cache_key(model_dir: Path, *, variant: Variant) -> str:
    """Names one build: the weights, the recipe and the onnxruntime that will load it."""
    import onnxruntime

    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with (model_dir / name).open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return f"{variant}-r{RECIPE_VERSION}-ort{onnxruntime.__version__}-{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_onnx(model_dir: Path, cache_dir: Path, *, name: str, variant: Variant) -> Path:
    """The cached ONNX file for `model_dir`, exporting it first if this cache lacks it."""
    target = cache_dir / name / cache_key(model_dir, variant=variant) / ONNX_FILE
    if target.exists():
        return target
    with _locked(target.parent.with_suffix(".lock")):
        if target.exists():  # another process built it while we waited
            return target
        log.info("onnx_export model=%s variant=%s cache=%s", name, variant, target.parent)
        command = [sys.executable, "-m", __name__, str(model_dir), str(target), variant]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not target.exists():
            raise RuntimeError(
                f"exporting {name} to ONNX failed (exit {done.returncode}): "
                f"{done.stderr.strip()[-2000:]}"
            )
    return target


def export(model_dir: Path, target: Path, *, variant: Variant) -> None:
    """Export, fuse and (for int8 and w8) quantise; `target` appears only when complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        raw = Path(tmp) / "raw.onnx"
        fused = Path(tmp) / "fused.onnx"
        _torch_export(model_dir, raw)
        _fuse(raw, fused, model_dir)
        final = Path(tmp) / f"{variant}.onnx"
        if variant == "int8":
            _quantize(fused, final)
        elif variant == "w8":
            _weights8(fused, final)
        else:
            final = fused
        os.replace(final, target)


def _torch_export(model_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(
        str(model_dir), attn_implementation="eager", local_files_only=True
    ).eval()

    class LastHiddenState(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            token_type_ids: torch.Tensor,
        ) -> torch.Tensor:
            return self.inner(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    # A padded batch, so the attention-mask path is traced.
    ids = torch.tensor([[101, 2023, 2003, 102, 0], [101, 2023, 2003, 1037, 102]])
    mask = (ids != 0).long()
    axes = {"batch": 0, "sequence": 1}
    dynamic = {n: {i: a for a, i in axes.items()} for n in [*_INPUTS, "last_hidden_state"]}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer warns about data-dependent branches
        torch.onnx.export(
            LastHiddenState(model),
            (ids, mask, torch.zeros_like(ids)),
            str(out),
            input_names=_INPUTS,
            output_names=["last_hidden_state"],
            dynamic_axes=dynamic,
            opset_version=17,
            do_constant_folding=True,
            dynamo=False,  # the TorchScript exporter: one self-contained file, no onnxscript
        )


def _fuse(raw: Path, out: Path, model_dir: Path) -> None:
    import json

    from onnxruntime.transformers import optimizer

    config = json.loads((model_dir / "config.json").read_text())
    model = optimizer.optimize_model(
        str(raw),
        model_type="bert",
        num_heads=int(config["num_attention_heads"]),
        hidden_size=int(config["hidden_size"]),
        opt_level=0,  # graph fusions only; the session applies its own optimisations on load
    )
    model.save_model_to_file(str(out))


def _quantize(fused: Path, out: Path) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        str(fused),
        str(out),
        per_channel=True,
        weight_type=QuantType.QInt8,
        # Fused graphs carry tensors whose type the quantiser cannot infer without this.
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )


def _weights8(fused: Path, out: Path) -> None:
    """8-bit weights, symmetric, one scale per block of 32 inputs of each output, multiplied
    in int8 against activations quantised per block (`accuracy_level` 4): the attention
    output and feed-forward layers; the fused attention keeps its fp32 input projection.
    On Zen 4 a single query embeds ~22 % faster than fp32 at cosine ≥ 0.9997 to it. With fp32
    products (level 0) it is 4x slower; blocks of 128 fall to cosine 0.9992; unfused
    attention with all 36 layers in 8 bits is no faster once other work has run between two
    queries, at 0.9995 (docs/benchmarks.md)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        onnx.load(str(fused)), bits=8, block_size=32, is_symmetric=True, accuracy_level=4
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(out), False)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[2] not in VARIANTS:
        print(
            "usage: python -m services.common.embedders.onnx_export MODEL_DIR TARGET "
            + "|".join(VARIANTS)
        )
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    variant: Variant = next(v for v in VARIANTS if v == argv[2])
    export(Path(argv[0]), Path(argv[1]), variant=variant)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
