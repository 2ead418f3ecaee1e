"""Builds the onnxruntime form of a sentence-transformers model directory, once, into a cache:
exported by torch (the inputs the model's forward takes), fused by onnxruntime's transformer
optimiser and, for `int8`, quantised dynamically per output channel (7-bit weights) by
onnxruntime's quantiser, all but the feed-forward down-projections (docs/benchmarks.md).
Nothing is downloaded. The export runs in a child process (`python -m
services.common.embedders.onnx_export`), so a serving process never imports torch; a file
lock keeps concurrent starts from exporting twice, and the result appears under its final
name only when complete."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Literal, cast

from filelock import FileLock

log = logging.getLogger(__name__)

# Bump when the recipe below changes: caches built by an older recipe are then rebuilt.
RECIPE_VERSION = 3
ONNX_FILE = "model.onnx"
_INPUTS = ["input_ids", "attention_mask", "token_type_ids"]

Variant = Literal["fp32", "int8"]
# Model types whose graphs onnxruntime's BERT optimiser fuses; others run unfused.
FUSED_TYPES = {"bert", "roberta", "xlm-roberta", "camembert", "electra"}


def cache_key(model_dir: Path, *, variant: Variant) -> str:
    """Names one build: the weights, the recipe and the onnxruntime that will load it."""
    import onnxruntime

    digest = hashlib.sha256()
    weights = next(
        n for n in ("model.safetensors", "pytorch_model.bin") if (model_dir / n).exists()
    )
    for name in ("config.json", weights):
        with (model_dir / name).open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return f"{variant}-r{RECIPE_VERSION}-ort{onnxruntime.__version__}-{digest.hexdigest()[:16]}"


def ensure_onnx(model_dir: Path, cache_dir: Path, *, name: str, variant: Variant) -> Path:
    """The cached ONNX file for `model_dir`, exporting it first if this cache lacks it."""
    target = cache_dir / name / cache_key(model_dir, variant=variant) / ONNX_FILE
    if target.exists():
        return target
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent.with_suffix(".lock")):
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
    """Export, fuse and (for int8) quantise; `target` appears only when complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        raw = Path(tmp) / "raw.onnx"
        fused = Path(tmp) / "fused.onnx"
        _torch_export(model_dir, raw)
        _fuse(raw, fused, model_dir)
        final = fused
        if variant == "int8":
            final = Path(tmp) / "int8.onnx"
            _quantize(fused, final)
        os.replace(final, target)


def _torch_export(model_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(
        str(model_dir), attn_implementation="eager", local_files_only=True
    ).eval()

    # The inputs this model's forward takes (a DistilBERT has no token types).
    names = [n for n in _INPUTS if n in inspect.signature(model.forward).parameters]

    class LastHiddenState(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            return self.inner(**dict(zip(names, inputs, strict=True))).last_hidden_state

    # A padded batch, so the attention-mask path is traced.
    ids = torch.tensor([[1, 5, 6, 2, 0], [1, 5, 6, 7, 2]])
    mask = (ids != 0).long()
    example = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    axes = {"batch": 0, "sequence": 1}
    dynamic = {n: {i: a for a, i in axes.items()} for n in [*names, "last_hidden_state"]}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer warns about data-dependent branches
        torch.onnx.export(
            LastHiddenState(model),
            tuple(example[n] for n in names),
            str(out),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_axes=dynamic,
            opset_version=17,
            do_constant_folding=True,
            dynamo=False,  # the TorchScript exporter: one self-contained file, no onnxscript
        )


def _fuse(raw: Path, out: Path, model_dir: Path) -> None:
    from onnxruntime.transformers import optimizer

    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") not in FUSED_TYPES:
        os.replace(raw, out)
        return
    model = optimizer.optimize_model(
        str(raw),
        model_type="bert",
        num_heads=int(config["num_attention_heads"]),
        hidden_size=int(config["hidden_size"]),
        opt_level=0,  # graph fusions only; the session applies its own optimisations on load
    )
    model.save_model_to_file(str(out))


# Activations whose output feeds a feed-forward down-projection.
_GELU = {"Gelu", "BiasGelu", "FastGelu", "QuickGelu"}


def _quantize(fused: Path, out: Path, *, reduce_range: bool = True) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = onnx.load(str(fused), load_external_data=False).graph
    made_by = {output: node.op_type for node in graph.node for output in node.output}
    # The feed-forward down-projections stay fp32: their input, after GELU (a fused op, or
    # the activation's own ops, named for it), has outliers that one dynamic scale per
    # tensor cannot resolve; quantising them cost the most quality (docs/benchmarks.md).
    down = [
        n.name
        for n in graph.node
        if n.op_type == "MatMul" and (made_by.get(n.input[0]) in _GELU or "act_fn" in n.input[0])
    ]
    quantize_dynamic(
        str(fused),
        str(out),
        per_channel=True,
        weight_type=QuantType.QInt8,
        # Without VNNI, pairs of 8-bit products saturate 16-bit sums; 7-bit ones are exact.
        reduce_range=reduce_range,
        nodes_to_exclude=down,
        # Fused graphs carry tensors whose type the quantiser cannot infer without this.
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )


if __name__ == "__main__":  # as `ensure_onnx` runs it: MODEL_DIR TARGET fp32|int8
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    model_dir, target, variant = sys.argv[1:]
    export(Path(model_dir), Path(target), variant=cast(Variant, variant))
