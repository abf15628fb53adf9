"""A draft's methods in the program, and the check of a draft against its target (the kind: exporters.components.draft).

``draft.checkpoint`` adds it. Its methods, ``draft_prefill`` and ``draft_decode_one_token``, are captured from the
draft model under the module prefix ``draft`` so its KV-cache buffers have names of their own (ExecuTorch shares a
mutable buffer between methods by name), and are lowered with the target's methods into one program: one file,
one load, each weight stored once. The decoder gets ``verify`` (``exporters.program.methods.with_verify``).
What needs the two checkpoints (same tokenizer, a family we build, smaller than the target) is checked when load opens
them (:func:`check_pair`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from exporters.config import DraftConfig, LayoutName, QuantConfig, quant_option
from exporters.errors import UserError
from exporters.program.adapters import adapter_method
from exporters.program.layouts import LAYOUTS
from models.families import FAMILIES, family_of_config
from models.tokenizer import find_tokenizer, load_tokenizer

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint

log = logging.getLogger("exporters")

DRAFT = "draft"  # the component's name: its methods' and buffers' prefix
DRAFT_KINDS = ("prefill", "decode")  # draft_prefill (the text so far), draft_decode_one_token (each proposal)
# What a runner looks for: draft_prefill, draft_decode_one_token.
DRAFT_METHODS = frozenset(adapter_method(DRAFT, LAYOUTS[LayoutName.stock].name_of(kind)) for kind in DRAFT_KINDS)
# Gemma 4's assistant's one method (exporters.components.assistant): (token int64[1, 1], its position int64[1]) ->
# the draft.tokens proposals int64[1, K] that follow it, from the decoder's caches and final hidden states.
ASSISTANT_METHOD = adapter_method(DRAFT, "propose")


def draft_quant(draft: DraftConfig, target: QuantConfig) -> QuantConfig:
    """How the draft (or Gemma 4's assistant) is quantized: ``draft.quant``'s preset, else the target's quant."""
    return quant_option(draft.quant, "draft.quant") if draft.quant is not None else target


def _vocabulary(checkpoint: "Checkpoint") -> dict[str, int]:
    path = find_tokenizer(checkpoint.path)
    if path is None:
        raise UserError(f"{checkpoint.path} has no tokenizer: a draft and its target must share one. Give "
                        "checkpoints with tokenizer.json or tokenizer.model.")
    return load_tokenizer(path).vocabulary()


def check_pair(target: "Checkpoint", draft: "Checkpoint", target_parameters: int, draft_parameters: int) -> None:
    """The draft proposes token ids the target reads: the same vocabulary (token -> id, not just its size), a
    family this tool builds, and (a warning) fewer parameters, or speculation costs more than it saves."""

    if family_of_config(draft.hf_config) is None:
        archs = ", ".join(draft.hf_config.architectures or [getattr(draft.hf_config, "model_type", "?")])
        raise UserError(f"draft.checkpoint={draft.path}: its architecture {archs} is not a family this tool builds "
                        f"({', '.join(FAMILIES)}). Give a draft of one of those families.")
    ours, theirs = _vocabulary(target), _vocabulary(draft)
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])
        example = next(((t, i) for t, i in differ if t in ours and t in theirs), differ[0])
        raise UserError(
            f"draft.checkpoint={draft.path} has another tokenizer than the target ({len(theirs)} against "
            f"{len(ours)} tokens, {len(differ)} (token, id) pairs differ, e.g. {example[0]!r} -> {example[1]}): its "
            "token ids mean other text, so every proposal would be rejected. Use a draft of the target's own family "
            "and tokenizer (Qwen2.5-Coder-0.5B for Qwen2.5-Coder-1.5B, ...).")
    if draft_parameters >= target_parameters:
        log.warning("draft.checkpoint=%s has %.0fM parameters, the target %.0fM: a draft as large as its target "
                    "costs more per proposal than verify saves. Use a smaller model of the same family.",
                    draft.path, draft_parameters / 1e6, target_parameters / 1e6)
