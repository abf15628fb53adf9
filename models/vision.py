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
from typing import Any, Callable

from models.errors import ModelError

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
    # config -> (S, N): the square every image is resized to, and the embedding positions it takes in the decoder;
    # None for a family whose vision encoder is not built yet: its checkpoint exports its text decoder alone.
    geometry: Callable[[Any], tuple[int, int]] | None

    def image_token_id(self, hf_config: Any) -> int:
        """The token each image position takes in a prompt (the config's, not the processor's: Gemma 3's processor
        names its begin-of-image token)."""
        return int(hf_config.image_token_id)


def _patches(vision_config: Any) -> int:
    return (vision_config.image_size // vision_config.patch_size) ** 2


def _llava_geometry(cfg: Any) -> tuple[int, int]:
    """CLIP's patches, plus its class token unless the ``default`` strategy drops it."""
    extra = 0 if cfg.vision_feature_select_strategy == "default" else 1
    return cfg.vision_config.image_size, _patches(cfg.vision_config) + extra


def _gemma3_geometry(cfg: Any) -> tuple[int, int]:
    """SigLIP's patches average-pooled to ``mm_tokens_per_image``."""
    return cfg.vision_config.image_size, int(cfg.mm_tokens_per_image)


def _idefics3_geometry(cfg: Any) -> tuple[int, int]:
    """SigLIP's patches, pixel-shuffled by ``scale_factor`` in each direction."""
    return cfg.vision_config.image_size, _patches(cfg.vision_config) // cfg.scale_factor**2


_TOWER_AND_PROJECTOR = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")
VISION_LANGUAGE: tuple[VisionLanguage, ...] = (
    VisionLanguage("llava", ("LlavaForConditionalGeneration",), _TOWER_AND_PROJECTOR, _llava_geometry),
    VisionLanguage("gemma3", ("Gemma3ForConditionalGeneration",), _TOWER_AND_PROJECTOR, _gemma3_geometry),
    VisionLanguage("idefics3", ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
                   ("model.vision_model.", "model.connector."), _idefics3_geometry),
    # Every Qwen3.5 on the hub is this class; its ViT (2D rotary patches, M-RoPE positions in the decoder) is not built,
    # so its text decoder exports alone, as transformers' Qwen3_5ForCausalLM loads it from the same files.
    VisionLanguage("qwen3_5", ("Qwen3_5ForConditionalGeneration",), ("model.visual.",), None),
)


def vision_language_of(hf_config: Any) -> VisionLanguage | None:
    """The vision-language architecture of ``config.json``, or None for a text checkpoint."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    return next((v for v in VISION_LANGUAGE for arch in archs if arch in v.architectures), None)


def text_only(hf_config: Any) -> str | None:
    """What the console says of a vision-language checkpoint whose vision encoder is not exported; None otherwise."""
    family = vision_language_of(hf_config)
    if family is None or family.geometry is not None:
        return None
    return f"text decoder only ({hf_config.architectures[0]}'s vision encoder is not exported yet)"


def language_config(hf_config: Any) -> Any:
    """The text decoder's config: ``text_config`` of a vision-language checkpoint (whose top-level
    ``tie_word_embeddings`` is what transformers ties by), else the config itself."""
    family = vision_language_of(hf_config)
    if family is None:
        return hf_config
    text = getattr(hf_config, "text_config", None)
    if text is None:
        raise ModelError(f"config.json names {hf_config.architectures[0]} (a vision-language model) but has no "
                         "text_config: the checkpoint is incomplete or its config was edited. Use the config.json the "
                         "checkpoint was saved with.")
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
