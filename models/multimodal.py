"""The text decoder inside a multimodal checkpoint (vision-language, audio-language), read as from a text checkpoint.

Such a checkpoint's ``config.json`` nests the decoder's config as ``text_config``, and its safetensors name the
decoder's tensors under one of the prefixes transformers has written over the years (``language_model.model.*`` in
the hub's older layout, ``model.language_model.*`` or ``model.text_model.*`` in the newer), beside the encoders'
(``models.vision``, ``models.audio_language``: which tensors are theirs). Everything that reads the text decoder goes
through :func:`language_config` and :func:`text_tensor_name`, so it is built and loaded as from a text checkpoint.
"""

from __future__ import annotations

from typing import Any

from models.audio_language import audio_language_of
from models.errors import ModelError
from models.vision import vision_language_of

# checkpoint prefix -> the prefix our decoder (and a text checkpoint) uses. The longest matching prefix wins.
TEXT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "model."),  # the hub's older layout (llava-hf, google/gemma-3-*, Voxtral)
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),  # transformers 5's own layout
    ("model.text_model.", "model."),  # Idefics3, SmolVLM
)


def encoder_prefixes(hf_config: Any) -> tuple[str, ...] | None:
    """The prefixes of a multimodal checkpoint's encoder and projector tensors; None for a text checkpoint."""
    vision = vision_language_of(hf_config)
    if vision is not None:
        return vision.vision_prefixes
    audio = audio_language_of(hf_config)
    return audio.audio_prefixes if audio is not None else None


def language_config(hf_config: Any) -> Any:
    """The text decoder's config: ``text_config`` of a multimodal checkpoint (whose top-level
    ``tie_word_embeddings``, where it has one, is what transformers ties by), else the config itself."""
    if encoder_prefixes(hf_config) is None:
        return hf_config
    text = getattr(hf_config, "text_config", None)
    if text is None:
        raise ModelError(f"config.json names {hf_config.architectures[0]} (a multimodal model) but has no "
                         "text_config: the checkpoint is incomplete or its config was edited. Use the config.json the "
                         "checkpoint was saved with.")
    tie = getattr(hf_config, "tie_word_embeddings", None)
    if tie is not None:
        text.tie_word_embeddings = bool(tie)
    vision = getattr(hf_config, "vision_config", None)
    text.sees_images = vision is not None  # Qwen3.5: M-RoPE positions only where images can come
    text.hears_audio = getattr(hf_config, "audio_config", None) is not None
    if getattr(vision, "deepstack_visual_indexes", None):  # Qwen3-VL: how many vision layers feed the decoder
        text.deepstack_layers = len(vision.deepstack_visual_indexes)
    # Gemma 4: the tokens whose per-layer embedding is the pad token's (the encoders' placeholders)
    text.placeholder_ids = tuple(int(i) for i in (getattr(hf_config, f"{media}_token_id", None)
                                                  for media in ("image", "audio", "video")) if i is not None)
    # Gemma 4 with use_bidirectional_attention=vision: the tokens whose runs attend both ways (transformers'
    # mm_token_type_ids 1 and 2)
    text.vision_ids = tuple(int(i) for i in (getattr(hf_config, f"{media}_token_id", None)
                                             for media in ("image", "video")) if i is not None)
    return text


def text_tensor_name(hf_config: Any, name: str) -> str | None:
    """The decoder's name for checkpoint tensor ``name``; None for an encoder's or projector's tensor (read by that
    encoder, not the decoder). A text checkpoint's names are the decoder's."""
    prefixes = encoder_prefixes(hf_config)
    if prefixes is None:
        return name
    if name.startswith(prefixes):
        return None
    for prefix, ours in sorted(TEXT_PREFIXES, key=lambda p: -len(p[0])):
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name  # lm_head.weight: the same in every layout
