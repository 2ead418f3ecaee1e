"""Tokenizers that count and chunk text as the model will see it: the local model's own
`tokenizer.json`, or tiktoken (from the BPE files litellm ships) for remote models."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)


def model_tokenizer(model_dir: Path, max_length: int | None = None) -> Tokenizer:
    """The model's own tokenizer, unpadded. With `max_length` (special tokens included) it
    cuts input as sentence-transformers does (not as the packaged file's own 128 would);
    without, it sees whole texts, as chunking and token counts need."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if max_length:
        tok.enable_truncation(max_length=max_length)
    else:
        tok.no_truncation()
    tok.no_padding()
    return tok


def tiktoken_tokenizer(model: str) -> object:
    """A tiktoken encoding for counting a remote model's tokens, or chonkie's `character`.

    The BPE files come from the copy litellm ships, so nothing is downloaded. Special tokens
    are removed from the encoding: a document that contains `<|endoftext|>` is text to count,
    not an error (tiktoken raises on special tokens by default, and chonkie calls plain
    `encode`).
    """
    spec = importlib.util.find_spec("litellm")
    if spec and spec.submodule_search_locations and "TIKTOKEN_CACHE_DIR" not in os.environ:
        litellm_dir = Path(next(iter(spec.submodule_search_locations)))
        bundled = litellm_dir / "litellm_core_utils" / "tokenizers"
        if bundled.is_dir():
            os.environ["TIKTOKEN_CACHE_DIR"] = str(bundled)
    try:
        import tiktoken

        try:
            name = tiktoken.encoding_name_for_model(model.split("/")[-1])
        except KeyError:
            name = "cl100k_base"
        base = tiktoken.get_encoding(name)
        return tiktoken.Encoding(
            name=f"{name}_no_special",
            pat_str=base._pat_str,
            mergeable_ranks=base._mergeable_ranks,
            special_tokens={},
        )
    except Exception as err:
        log.warning(
            "tiktoken_unavailable model=%s error=%r fallback=character", model, str(err)[:200]
        )
        return "character"
