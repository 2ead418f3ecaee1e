"""bfloat16 BERT layers with their bias, activation and residual add fused into the matrix
multiply (oneDNN, through torch's `mkldnn::_linear_pointwise`, the kernel torch's own
compiler emits for CPU linear layers).

Plain bfloat16 spends about 30 % of a document batch (profiled, one thread, batches of 32)
on three steps around the matrix multiplies: the exact GELU over every intermediate
activation, the bias copied into each output before the multiply, the residual add.
Fused, each of those is done on the multiply's output tile while it is still in cache:
10-20 % more chunks/s on a single thread, the same vectors to within bfloat16 rounding
(checked on every load, see `fuse_bert`).

Only what is known is replaced: a layer whose structure or activation is not the one
below, or a torch without the kernel, keeps its own modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

_pointwise: Any = getattr(torch.ops.mkldnn, "_linear_pointwise", None)

# Two texts of different lengths, so that the check covers padding and the attention mask.
_PROBE = [
    "Restart the service after changing its configuration file.",
    "The scheduler assigns each task to the least loaded worker; when a worker stops "
    "answering, its tasks return to the queue and are retried with exponential back-off, "
    "at most five times, before they are reported as failed to the caller.",
]


class DenseGelu(nn.Module):
    """`BertIntermediate`: dense then exact GELU."""

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        self.weight = dense.weight
        self.bias = dense.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _pointwise(hidden, self.weight, self.bias, "gelu", [], "none")


class DenseAddNorm(nn.Module):
    """`BertSelfOutput` / `BertOutput` in inference: dense, residual add, layer norm
    (their dropout is the identity outside training)."""

    def __init__(self, dense: nn.Linear, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.weight = dense.weight
        self.bias = dense.bias
        self.LayerNorm = norm

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        fused = _pointwise.binary(hidden, residual, self.weight, self.bias, "add")
        return self.LayerNorm(fused)


def _exact_gelu(act: object) -> bool:
    if isinstance(act, nn.GELU):
        return act.approximate == "none"
    # transformers' GELUActivation: nn.functional.gelu unless told to use its Python copy.
    return (
        type(act).__name__ == "GELUActivation" and getattr(act, "act", None) is nn.functional.gelu
    )


def _output_block(block: object) -> bool:
    return (
        isinstance(getattr(block, "dense", None), nn.Linear)
        and isinstance(getattr(block, "LayerNorm", None), nn.LayerNorm)
        and isinstance(getattr(block, "dropout", None), nn.Dropout)
    )


def _fusable(layer: nn.Module) -> bool:
    intermediate = getattr(layer, "intermediate", None)
    attention = getattr(layer, "attention", None)
    return (
        isinstance(getattr(intermediate, "dense", None), nn.Linear)
        and _exact_gelu(getattr(intermediate, "intermediate_act_fn", None))
        and _output_block(getattr(layer, "output", None))
        and _output_block(getattr(attention, "output", None))
    )


def fuse_bert(model: nn.Module, check: Callable[[], torch.Tensor]) -> bool:
    """Replace the dense blocks of a bfloat16 BERT encoder in eval mode by fused ones, if
    the kernel exists and every layer is a known BERT layer. `check` embeds a probe in the
    model as it is: it is run before and after, and any difference beyond bfloat16
    rounding (or any error) puts the original modules back. True when fused."""
    layers = getattr(getattr(model, "encoder", None), "layer", None)
    if _pointwise is None or model.training or not layers or not all(map(_fusable, layers)):
        return False
    before = check()
    originals = [
        (layer, layer.intermediate, layer.output, layer.attention.output) for layer in layers
    ]
    for layer in layers:
        layer.intermediate = DenseGelu(layer.intermediate.dense)
        layer.output = DenseAddNorm(layer.output.dense, layer.output.LayerNorm)
        attention = layer.attention
        attention.output = DenseAddNorm(attention.output.dense, attention.output.LayerNorm)
    try:
        after = check()
        agree = bool(torch.nn.functional.cosine_similarity(before, after).min() >= 0.9999)
    except RuntimeError:  # e.g. a oneDNN without bfloat16 kernels for this CPU
        agree = False
    if not agree:
        for layer, intermediate, output, attention_output in originals:
            layer.intermediate, layer.output = intermediate, output
            layer.attention.output = attention_output
    return agree


def fuse_sentence_transformer(st: Any) -> bool:
    """A bfloat16 sentence-transformers model's BERT fused in place (`fuse_bert`), checked
    on `_PROBE`; True when fused."""
    model = getattr(st[0], "auto_model", None)
    fused = model is not None and fuse_bert(
        model, lambda: st.encode(_PROBE, convert_to_tensor=True, show_progress_bar=False).float()
    )
    if not fused:  # correct, only slower: say so where an operator looks
        log.warning("bfloat16 encoder runs unfused: this torch or model is not the one expected")
    return fused
