"""The tied embedding: one decision, made once, for a checkpoint whose ``lm_head`` is its token embedding.

Small models (SmolLM2, Llama 3.2 1B, Gemma) share one [vocab, hidden] matrix between the embedding and the
output projection. What the program stores depends on the quantization of the two roles and on
``export.tied_embedding``; :func:`plan_tied_embedding` decides, and :func:`exporters.quant.apply.quantize_model`
carries the decision out (it is the only code that unties, re-ties, or sets the decoder's ``tied_head``).
Measured costs of each choice are in docs/DESIGN.md.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exporters.config import QuantConfig, TiedEmbeddingStorage
    from models.decoder import CausalLM


class TiedEmbedding(str, Enum):
    """What becomes of a tied matrix; the value is what the manifest records (``quantization.tied_embedding``)."""

    NOT_TIED = "not tied"
    # Unquantized, stored once: lm_head computes its logits from the embedding's own parameter
    # (``CausalLM.tied_head``), so no delegate keeps a second copy.
    SHARED = "shared"
    # Unquantized, and lm_head gets its own constant (export.tied_embedding=copied): XNNPACK packs it once at
    # load instead of at every call, at the cost of a second copy in the file.
    COPIED = "copied"
    # Both roles quantized with the same scheme and group size: one quantized tensor serves both.
    QUANTIZED_ONCE = "quantized once"
    # The roles are quantized differently: lm_head gets its own copy before quantization.
    UNTIED = "untied"


def is_tied(model: CausalLM) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def head_scheme(quant: QuantConfig) -> str | None:
    """How lm_head is quantized: torchao's ``quant.lm_head``, or the PT2E quantizer (it quantizes every linear,
    lm_head included, after capture)."""
    return quant.lm_head or (f"pt2e {quant.pt2e}" if quant.pt2e else None)


def plan_tied_embedding(model: CausalLM, quant: QuantConfig, storage: TiedEmbeddingStorage) -> TiedEmbedding:
    if not is_tied(model):
        return TiedEmbedding.NOT_TIED
    head = (head_scheme(quant), quant.lm_head_group_size if quant.lm_head else None)
    embedding = (quant.embedding, quant.embedding_group_size if quant.embedding else None)
    if head != embedding:
        return TiedEmbedding.UNTIED
    if quant.embedding is not None:
        return TiedEmbedding.QUANTIZED_ONCE
    return TiedEmbedding.COPIED if storage == "copied" else TiedEmbedding.SHARED


def note(plan: TiedEmbedding, quant: QuantConfig) -> str | None:
    """The manifest's note on what was done, or None for a checkpoint without a tied embedding."""
    return {
        TiedEmbedding.NOT_TIED: None,
        TiedEmbedding.SHARED: "tied embedding stored once, lm_head reads it",
        TiedEmbedding.COPIED: "tied embedding copied for lm_head (export.tied_embedding=copied)",
        TiedEmbedding.QUANTIZED_ONCE: f"tied embedding kept tied: both quantized as {quant.embedding}",
        TiedEmbedding.UNTIED: (f"tied embedding untied: lm_head quantized as {head_scheme(quant) or quant.dtype}, "
                               f"embedding as {quant.embedding or quant.dtype}"),
    }[plan]
