"""The draft component: a smaller model with the target's tokenizer whose methods propose tokens for ``verify``.

``draft.checkpoint`` adds it. Its methods, ``draft_prefill`` and ``draft_decode_one_token``, are captured from the
draft model under the module prefix ``draft`` so its KV-cache buffers have names of their own (ExecuTorch shares a
mutable buffer between methods by name), and are lowered with the target's methods into one program: one file,
one load, each weight stored once. The decoder gets ``verify`` (``exporters.program.methods.with_verify``).
What can be checked from the config is checked with the config (:func:`check_draft`); what needs the two
checkpoints (same tokenizer, a family we build, smaller than the target) when load opens them (:func:`check_pair`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from exporters.config import (Attention, DraftConfig, ExportConfig, LayoutName, ModelConfig, QuantConfig,
                              TiedEmbeddingStorage, quant_option)
from exporters.errors import UserError
from exporters.plan.component import Component, ComponentKind, HeadVocabulary, ModelBuild, QuantPlan, StatePlan
from exporters.plan.lengths import Lengths
from exporters.program.adapters import adapter_method
from exporters.program.layouts import LAYOUTS
from exporters.program.methods import MethodTable

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint

log = logging.getLogger("exporters")

DRAFT = "draft"  # the component's name: its methods' and buffers' prefix
DRAFT_KINDS = ("prefill", "decode")  # draft_prefill (the text so far), draft_decode_one_token (each proposal)
# What a runner looks for: draft_prefill, draft_decode_one_token.
DRAFT_METHODS = frozenset(adapter_method(DRAFT, LAYOUTS[LayoutName.stock].name_of(kind)) for kind in DRAFT_KINDS)


def draft_quant(draft: DraftConfig, target: QuantConfig) -> QuantConfig:
    return quant_option(draft.quant, "draft.quant") if draft.quant is not None else target


def draft_component(draft: DraftConfig, target_quant: QuantConfig, state: StatePlan, attention: Attention,
                    lengths: Lengths, tied: TiedEmbeddingStorage, shortcuts: bool) -> Component | None:
    """The draft as a component of the plan (None without ``draft.checkpoint``): its cache is the target's shape,
    so it proposes wherever the target can verify."""
    if draft.checkpoint is None:
        return None
    model = ModelConfig(name=DRAFT, checkpoint=draft.checkpoint)  # its family from its own config.json
    head = HeadVocabulary(draft.vocab, draft.vocab_text) if draft.vocab is not None else None
    return Component(name=DRAFT, kind=ComponentKind.draft, build=ModelBuild(model, state, attention, head),
                     quant=QuantPlan(draft_quant(draft, target_quant), tied, shortcuts),
                     methods=MethodTable.for_component(DRAFT, DRAFT_KINDS, lengths))


def check_draft(cfg: ExportConfig) -> None:
    """The draft's settings, before any work (the pair itself is checked by :func:`check_pair` at load)."""
    from exporters.quant.schemes import check_quant

    draft = cfg.draft
    if draft.checkpoint is None:
        for key, value in (("quant", draft.quant), ("vocab", draft.vocab), ("vocab_text", draft.vocab_text)):
            if value is not None:
                raise UserError(f"draft.{key}={value} without draft.checkpoint: there is no draft to apply it to. "
                                f"Give draft.checkpoint=<folder or .gguf> or leave draft.{key} unset.")
        return
    if draft.vocab_text is not None and draft.vocab is None:
        raise UserError(f"draft.vocab_text={draft.vocab_text} without draft.vocab: the text ranks the tokens a "
                        "restricted draft keeps. Give draft.vocab=<how many> (32768 keeps 94% of English and code "
                        "tokens for Qwen2.5) or leave draft.vocab_text unset.")
    if draft.vocab_text is not None:
        from exporters.runtime.quality import read_text

        read_text(draft.vocab_text, key="draft.vocab_text",
                  fix="Give a UTF-8 text of the kind your app generates with draft.vocab_text=<path>, or leave it "
                      "unset to rank tokens by the tokenizer's order. Nothing was exported.")
    if not Path(draft.checkpoint).expanduser().exists():
        raise UserError(f"draft.checkpoint={draft.checkpoint} does not exist: give a Hugging Face folder or a GGUF "
                        "file of a smaller model with the target's tokenizer. Nothing was exported.")
    if cfg.model.adapters:
        raise UserError("draft.checkpoint with model.adapters: speculative programs do not hold adapters yet (the "
                        "draft would propose for the base model only). Export the adapters without a draft, or the "
                        "draft without adapters.")
    quant = draft_quant(draft, cfg.quant)
    if quant.pt2e is not None:
        raise UserError(f"draft.quant={draft.quant}: a PT2E quantizer converts one graph of the target; the draft is "
                        "quantized with torchao. Use a torchao preset (draft.quant=8da4w, 8da8w, fp32, ...).")
    check_quant(quant, cfg.backend)


def _vocabulary(checkpoint: "Checkpoint") -> dict[str, int]:
    from models.tokenizer import find_tokenizer, load_tokenizer

    path = find_tokenizer(checkpoint.path)
    if path is None:
        raise UserError(f"{checkpoint.path} has no tokenizer: a draft and its target must share one. Give "
                        "checkpoints with tokenizer.json or tokenizer.model.")
    return load_tokenizer(path).vocabulary()


def check_pair(target: "Checkpoint", draft: "Checkpoint", target_parameters: int, draft_parameters: int) -> None:
    """The draft proposes token ids the target reads: the same vocabulary (token -> id, not just its size), a
    family this tool builds, and (a warning) fewer parameters, or speculation costs more than it saves."""
    from models.families import FAMILIES, family_of_config

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
