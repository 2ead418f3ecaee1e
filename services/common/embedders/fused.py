"""bfloat16 BERT layers with their bias, activation and residual add fused into the matrix
multiply (oneDNN, through torch's `mkldnn::_linear_pointwise`, the kernel torch's own
compiler emits for CPU linear layers).

Plain bfloat16 spends about 30 % of a document batch (profiled, one thread, batches of 32)
on three steps around the matrix multiplies: the exact GELU over every intermediate
activation, the bias copied into each output before the multiply, the residual add.
Fused, each of those is done on the multiply's output tile while it is still in cache:
10-20 % more chunks/s on a single thread, the same vectors to within bfloat16 rounding
(checked on every load, see `fuse_bert`).

Self-attention gets the same treatment: its query, key and value projections run as one
multiply with their bias inside it, and attention takes the padding mask as one row per text
instead of a full square per text (torch's CPU attention converts the mask it is given to
floats at every layer). On a Xeon with AMX, 256 man-page chunks, one thread: the three
projections took 10 % of a batch and that mask conversion 4 %; with both fused, 1.07x the
chunks/s (docs/benchmarks.md).

(On a CPU with AMX, documents run in amx.c instead, see amx.py.)

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


class PaddingMask:
    """The attention mask of one forward pass reduced to one row per text, computed once
    for all layers (they are all handed the same tensor). BERT's mask hides padded keys
    from every query alike, so its rows repeat; a mask whose rows differ is passed as is."""

    def __init__(self) -> None:
        self._mask: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None

    def __call__(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        if mask is None or mask.dim() != 4:
            return mask
        if mask is not self._mask:
            row = mask[:, :, :1, :]
            self._mask = mask
            self._rows = row if torch.equal(mask, row.expand_as(mask)) else mask
        return self._rows


class FusedSelfAttention(nn.Module):
    """`BertSelfAttention` of an encoder in inference: one multiply for query, key and value,
    then torch's scaled dot-product attention (what transformers' `sdpa` runs)."""

    def __init__(self, attention: Any, masks: PaddingMask) -> None:
        super().__init__()
        projections = (attention.query, attention.key, attention.value)
        self.weight = nn.Parameter(torch.cat([p.weight for p in projections]).detach(), False)
        self.bias = nn.Parameter(torch.cat([p.bias for p in projections]).detach(), False)
        self.heads: int = attention.num_attention_heads
        self.head_size: int = attention.attention_head_size
        self.scaling: float = attention.scaling
        self.masks = masks

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        cache: object = None,
        **_: object,
    ) -> tuple[torch.Tensor, None]:
        if encoder_hidden_states is not None or cache is not None:
            # Only an encoder's is fused (`_self_attention`); a decoder's cache would be ignored.
            raise RuntimeError("fused self-attention serves encoders only")
        batch, length, _hidden = hidden_states.shape
        qkv = _pointwise(hidden_states, self.weight, self.bias, "none", [], "")
        shape = (batch, length, 3, self.heads, self.head_size)
        query, key, value = qkv.view(shape).permute(2, 0, 3, 1, 4).unbind(0)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=self.masks(attention_mask), scale=self.scaling
        )
        return out.transpose(1, 2).reshape(batch, length, -1), None


class DenseAddNorm(nn.Module):
    """`BertSelfOutput` / `BertOutput` in inference: dense, residual add, layer norm
    (their dropout is the identity outside training)."""

    def __init__(self, dense: nn.Linear, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.weight = dense.weight
        self.bias = dense.bias
        self.LayerNorm = norm

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(_pointwise.binary(hidden, residual, self.weight, self.bias, "add"))


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


def _self_attention(attention: object) -> bool:
    """Whether a layer's attention is an encoder's self-attention as `FusedSelfAttention`
    computes it; one that is not keeps its module, and the dense blocks are fused alone."""
    block = getattr(attention, "self", None)
    return (
        not getattr(attention, "is_cross_attention", False)
        and not getattr(block, "is_decoder", True)
        and all(isinstance(getattr(block, p, None), nn.Linear) for p in ("query", "key", "value"))
        and isinstance(getattr(block, "scaling", None), float)
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
    model as it is: it is run before and after, and any difference beyond bfloat16 rounding
    (or any error) puts the original modules back. True when fused."""
    layers = getattr(getattr(model, "encoder", None), "layer", None)
    if _pointwise is None or model.training or not layers or not all(map(_fusable, layers)):
        return False
    before = check()
    originals = [
        (layer, layer.intermediate, layer.output, layer.attention.self, layer.attention.output)
        for layer in layers
    ]
    masks = PaddingMask()
    for layer in layers:
        layer.intermediate = DenseGelu(layer.intermediate.dense)
        layer.output = DenseAddNorm(layer.output.dense, layer.output.LayerNorm)
        block = layer.attention
        if _self_attention(block):
            block.self = FusedSelfAttention(block.self, masks)
        block.output = DenseAddNorm(block.output.dense, block.output.LayerNorm)
    try:
        after = check()
        agree = bool(torch.nn.functional.cosine_similarity(before, after).min() >= 0.9999)
    except RuntimeError:  # e.g. a oneDNN without bfloat16 kernels for this CPU
        agree = False
    if not agree:
        for layer, intermediate, output, self_attention, attention_output in originals:
            layer.intermediate, layer.output = intermediate, output
            layer.attention.self, layer.attention.output = self_attention, attention_output
    return agree


def fuse_sentence_transformer(st: Any) -> bool:
    """A bfloat16 sentence-transformers model's BERT fused in place (`fuse_bert`), checked
    on `_PROBE`; True when fused."""
    model = getattr(st[0], "auto_model", None)
    fused = model is not None and fuse_bert(
        model,
        lambda: st.encode(_PROBE, convert_to_tensor=True, show_progress_bar=False).float(),
    )
    if not fused:  # correct, only slower: say so where an operator looks
        log.warning("bfloat16 encoder runs unfused: this torch or model is not the one expected")
    return fused
