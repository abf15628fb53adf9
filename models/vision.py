"""Vision-language checkpoints: which ones we read, where their text decoder's tensors are, and its config.

A vision-language checkpoint (LLaVA, Gemma 3, Idefics3 / SmolVLM) holds a text decoder of a family we already
implement (``models.families``) beside a vision tower and a projector. Its ``config.json`` nests the decoder's
config as ``text_config``, and its safetensors name the decoder's tensors under one of the prefixes transformers
has written over the years (``language_model.model.*`` in the hub's older layout, ``model.language_model.*`` or
``model.text_model.*`` in the newer). Everything that reads the text decoder goes through :func:`language_config`
and :func:`text_tensor_name`, so the decoder is built and loaded as from a text checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Where transformers' vision-language checkpoints keep the text decoder, in every layout it reads: checkpoint
# prefix -> the prefix our decoder (and a text checkpoint) uses. The longest matching prefix wins.
TEXT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "model."),  # the hub's older layout (llava-hf, google/gemma-3-*)
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),  # transformers 5's own layout
    ("model.text_model.", "model."),  # Idefics3, SmolVLM
)


@dataclass(frozen=True)
class VisionLanguage:
    """One vision-language architecture: its text decoder is a family of ``models.families``."""

    name: str
    architectures: tuple[str, ...]
    # Prefixes of the tensors that are not the text decoder's (the vision tower and the projector), every layout.
    vision_prefixes: tuple[str, ...]
    image_token_key: str  # the config attribute holding the id of the token each image position takes


VISION_LANGUAGE: tuple[VisionLanguage, ...] = (
    VisionLanguage("llava", ("LlavaForConditionalGeneration",),
                   ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
                   "image_token_id"),
    VisionLanguage("gemma3", ("Gemma3ForConditionalGeneration",),
                   ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
                   "image_token_id"),
    VisionLanguage("idefics3", ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
                   ("model.vision_model.", "model.connector."), "image_token_id"),
)


def vision_language_of(hf_config: Any) -> VisionLanguage | None:
    """The vision-language architecture of ``config.json``, or None for a text checkpoint."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    return next((v for v in VISION_LANGUAGE for arch in archs if arch in v.architectures), None)


def language_config(hf_config: Any) -> Any:
    """The text decoder's config: ``text_config`` of a vision-language checkpoint (whose top-level
    ``tie_word_embeddings`` is what transformers ties by), else the config itself."""
    if vision_language_of(hf_config) is None:
        return hf_config
    text = hf_config.text_config
    tie = getattr(hf_config, "tie_word_embeddings", None)
    if tie is not None:
        text.tie_word_embeddings = bool(tie)
    return text


def text_tensor_name(hf_config: Any, name: str) -> str | None:
    """The decoder's name for checkpoint tensor ``name``; None for a vision tower's or projector's tensor (read by
    the vision encoder, not the decoder). A text checkpoint's names are the decoder's."""
    vl = vision_language_of(hf_config)
    if vl is None:
        return name
    if name.startswith(vl.vision_prefixes):
        return None
    for prefix, ours in sorted(TEXT_PREFIXES, key=lambda p: -len(p[0])):
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name  # lm_head.weight: the same in every layout
