"""Vision-language checkpoints: which ones we read, where their text decoder's tensors are, and its config.

A vision-language checkpoint (LLaVA, Gemma 3, Idefics3 / SmolVLM) holds a text decoder of a family we already
implement (``models.families``) beside a vision tower and a projector; ``models.multimodal`` reads its text decoder
as from a text checkpoint, this module says which architectures these are and what their images take.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from models.errors import ModelError
from models.processor_files import PROCESSOR_FILES, processor_settings

@dataclass(frozen=True)
class VisionLanguage:
    """One vision-language architecture: its text decoder is a family of ``models.families``."""

    name: str
    architectures: tuple[str, ...]
    # Prefixes of the tensors that are not the text decoder's (the vision tower and the projector), every layout.
    vision_prefixes: tuple[str, ...]
    # (config, the processor's saved fields) -> (S, N): the square every image is resized to, and the embedding
    # positions it takes in the decoder; None for a family whose vision encoder is not built yet: its checkpoint
    # exports its text decoder alone.
    geometry: Callable[[Any, dict[str, Any]], tuple[int, int]] | None
    # The processor takes any size in a range (Qwen-VL's least and most pixels, Gemma 4's token budget) and the
    # program one square, which model.image_size may choose (the run's processor files are written with it); else the
    # size is the processor's.
    size_chosen: bool = False
    # S -> the processor's ``size`` field for one S x S square (size_chosen): Qwen-VL's least and most pixels.
    sized: Callable[[int], dict[str, int]] = lambda side: {"shortest_edge": side * side, "longest_edge": side * side}
    # Each image token's place in its image travels in the embedding (Qwen-VL's M-RoPE channels), which a half-precision
    # dtype holds exactly only up to a count (exporters.components.vision).
    places_in_embedding: bool = False

    def image_token_id(self, hf_config: Any) -> int:
        """The token each image position takes in a prompt (the config's, not the processor's: Gemma 3's processor
        names its begin-of-image token)."""
        return int(hf_config.image_token_id)


def _patches(vision_config: Any) -> int:
    return (vision_config.image_size // vision_config.patch_size) ** 2


def _llava_geometry(cfg: Any, processor: dict[str, Any]) -> tuple[int, int]:
    """CLIP's patches, plus its class token unless the ``default`` strategy drops it."""
    extra = 0 if cfg.vision_feature_select_strategy == "default" else 1
    return cfg.vision_config.image_size, _patches(cfg.vision_config) + extra


def _gemma3_geometry(cfg: Any, processor: dict[str, Any]) -> tuple[int, int]:
    """SigLIP's patches average-pooled to ``mm_tokens_per_image``."""
    return cfg.vision_config.image_size, int(cfg.mm_tokens_per_image)


def _idefics3_geometry(cfg: Any, processor: dict[str, Any]) -> tuple[int, int]:
    """SigLIP's patches, pixel-shuffled by ``scale_factor`` in each direction."""
    return cfg.vision_config.image_size, _patches(cfg.vision_config) // cfg.scale_factor**2


def _check_processor_agrees(processor: dict[str, Any], ours: dict[str, int], defaults: dict[str, int]) -> None:
    """The processor's fields (``defaults`` where it sets none) equal config.json's ``ours``, or the files are not
    this checkpoint's."""
    for key, value in ours.items():
        theirs = processor.get(key, defaults[key])
        if theirs != value:
            raise ModelError(f"the processor's {key}={theirs} and config.json's {value} disagree: the processor files "
                             "are not this checkpoint's. Copy the checkpoint's own processor_config.json beside it.")


def _chosen_side(image_size: int, unit: int, cut: str, example: str) -> int:
    """model.image_size as S when it is a positive multiple of ``unit`` (``cut``: how the checkpoint cuts images)."""
    if image_size <= 0 or image_size % unit:
        raise ModelError(f"model.image_size={image_size}: this checkpoint's images are cut into patches of {cut}, so "
                         f"the side must be a multiple of {unit} ({example}).")
    return image_size


def _lfm2_vl_geometry(cfg: Any, processor: dict[str, Any]) -> tuple[int, int]:
    """One square image of ``max_image_tokens`` positions (SigLIP2's patches, pixel-unshuffled by
    ``downsample_factor``): the processor's token budget fixes the side, as its tiles are squares."""
    # transformers' PIL image processors (SigLIP2's): loaded only when an LFM2-VL checkpoint is read.
    from models.lfm2_vl_images import LFM2_VL_DEFAULTS, square_side

    _check_processor_agrees(processor, {"encoder_patch_size": cfg.vision_config.patch_size,
                                        "downsample_factor": cfg.downsample_factor}, LFM2_VL_DEFAULTS)
    try:
        return square_side(processor)
    except ValueError as e:
        raise ModelError(f"the processor's {e}. Set max_image_tokens in processor_config.json to a square.") from None


def fixed_side(settings: dict[str, Any], multiple: int) -> int | None:
    """S of a Qwen-VL processor whose ``size`` fixes one square of S * S pixels (a multiple of ``multiple``: patch
    times merge); None when it takes a range (the hub's) or its count is no such square."""
    size = settings.get("size") or {}
    low = settings.get("min_pixels", size.get("shortest_edge"))
    high = settings.get("max_pixels", size.get("longest_edge"))
    if low is None or low != high:
        return None
    side = math.isqrt(int(high))
    return side if side * side == int(high) and side % multiple == 0 else None


#: S for a Qwen-VL checkpoint whose processor takes a range of sizes (the hub's), rounded down to patch x merge.
QWEN_VL_SIDE = 448


def _qwen_vl_geometry(cfg: Any, processor: dict[str, Any], image_size: int | None = None) -> tuple[int, int] | None:
    """One square of S x S pixels: patches of p, merged m x m into one position each, (S / (p m))^2 positions. S is
    ``image_size`` (model.image_size) when given, else the processor's when its size fixes one square; a random-weight
    shape (no processor) takes 448 (rounded). None: the processor takes a range of sizes and none was chosen, so the
    text decoder exports alone (:func:`text_only` says how to export the image path)."""
    vc = cfg.vision_config
    unit = vc.patch_size * vc.spatial_merge_size
    default = QWEN_VL_SIDE // unit * unit
    example = f"e.g. model.image_size={default} for {(default // unit) ** 2} positions per image"
    if image_size is not None:
        side = _chosen_side(image_size, unit, f"{vc.patch_size} merged {vc.spatial_merge_size} x "
                            f"{vc.spatial_merge_size}", example)
        return side, (side // unit) ** 2
    side = fixed_side(processor, unit)
    if side is None:
        if processor:
            return None
        side = default
    return side, (side // unit) ** 2


def _gemma4_geometry(cfg: Any, processor: dict[str, Any], image_size: int | None = None) -> tuple[int, int]:
    """One square of S x S pixels: patches of p pooled k x k into one position each, (S / (k p))^2 positions. S is
    ``image_size`` (model.image_size) when given, else the processor's saved square (a run's files; a stale ``size``
    of no whole cells is ignored, as transformers ignores it), else the largest square within its ``max_soft_tokens``
    (the hub's 280: 768 px, 256 positions)."""
    from models.gemma4_images import program_side  # transformers' PIL image processors: only for Gemma 4

    vc = cfg.vision_config
    ours = {"patch_size": vc.patch_size, "pooling_kernel_size": vc.pooling_kernel_size}
    _check_processor_agrees(processor, ours, ours)
    unit = vc.patch_size * vc.pooling_kernel_size
    if image_size is not None:
        side = _chosen_side(image_size, unit, f"{vc.patch_size} pooled {vc.pooling_kernel_size} x "
                            f"{vc.pooling_kernel_size}", f"e.g. model.image_size={16 * unit} for 256 positions per image")
    else:
        side = program_side(processor.get("size"), int(processor.get("max_soft_tokens", 280)), vc.patch_size,
                            vc.pooling_kernel_size)
    return side, (side // unit) ** 2


def size_to_choose(hf_config: Any) -> str:
    """How to export the image path of a checkpoint whose processor takes a range of sizes."""
    vc = hf_config.vision_config
    unit = vc.patch_size * vc.spatial_merge_size
    default = QWEN_VL_SIDE // unit * unit
    return (f"its processor takes images of any size in a range and a program takes one square: "
            f"model.image_size=S exports the image path (S a multiple of {unit}, e.g. {default} for "
            f"{(default // unit) ** 2} positions per image)")


def _qwen_vl_processor(processor_class: str) -> Callable[[Path], Any]:
    def load(folder: Path) -> Any:
        from models.qwen_vl_images import qwen_vl_processor  # transformers' PIL image processors: only for Qwen-VL

        return qwen_vl_processor(folder, processor_class)

    return load


def _gemma4_processor(folder: Path) -> Any:
    from models.gemma4_images import gemma4_processor  # transformers' PIL image processors: only for Gemma 4

    return gemma4_processor(folder)


def _lfm2_vl_processor(folder: Path) -> Any:
    from models.lfm2_vl_images import lfm2_vl_processor  # transformers' PIL image processors: only for LFM2-VL

    return lfm2_vl_processor(folder)


_TOWER_AND_PROJECTOR = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")
VISION_LANGUAGE: tuple[VisionLanguage, ...] = (
    VisionLanguage("llava", ("LlavaForConditionalGeneration",), _TOWER_AND_PROJECTOR, _llava_geometry),
    VisionLanguage("gemma3", ("Gemma3ForConditionalGeneration",), _TOWER_AND_PROJECTOR, _gemma3_geometry),
    VisionLanguage("idefics3", ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
                   ("model.vision_model.", "model.connector."), _idefics3_geometry),
    # LFM2-VL: SigLIP2 (NaFlex) beside an LFM2 decoder; one square image per picture (no tiles).
    VisionLanguage("lfm2_vl", ("Lfm2VlForConditionalGeneration",), _TOWER_AND_PROJECTOR, _lfm2_vl_geometry),
    # Every Qwen3.5 on the hub is this class: Qwen3-VL's tower (without deepstack) beside the hybrid decoder.
    VisionLanguage("qwen3_5", ("Qwen3_5ForConditionalGeneration",), ("model.visual.",), _qwen_vl_geometry,
                   size_chosen=True, places_in_embedding=True),
    # Qwen2.5-VL and Qwen3-VL: one square image (models.vision_encoder), M-RoPE decoders whose image positions the
    # program keeps (models.decoder), so the stock runner's one start position suffices.
    VisionLanguage("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), ("model.visual.", "visual."),
                   _qwen_vl_geometry, size_chosen=True, places_in_embedding=True),
    VisionLanguage("qwen3_vl", ("Qwen3VLForConditionalGeneration",), ("model.visual.", "visual."), _qwen_vl_geometry,
                   size_chosen=True, places_in_embedding=True),
    # Gemma 4 ships as this class (image and audio towers beside the decoder): one square image
    # (models.vision_encoder), whose tokens carry their id to the per-layer embeddings (models.decoder); the audio
    # tower is not exported (issue 64).
    VisionLanguage("gemma4", ("Gemma4ForConditionalGeneration",),
                   ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio."),
                   _gemma4_geometry, size_chosen=True, sized=lambda side: {"height": side, "width": side}),
)


# Processors (by the class their saved files name) that transformers cannot load here, and what we load instead.
OWN_PROCESSORS: dict[str, Callable[[Path], Any]] = {
    "Lfm2VlProcessor": _lfm2_vl_processor, "Gemma4Processor": _gemma4_processor,
    "Qwen2_5_VLProcessor": _qwen_vl_processor("Qwen2_5_VLProcessor"),
    "Qwen3VLProcessor": _qwen_vl_processor("Qwen3VLProcessor")}


def load_processor(folder: Path) -> Any:
    """The processor saved in ``folder`` (a checkpoint or a run): transformers' own, or ours where its own needs
    what this project cannot install (:data:`OWN_PROCESSORS`)."""
    files = (Path(folder) / name for name in PROCESSOR_FILES)
    saved = [json.loads(path.read_text()) for path in files if path.is_file()]
    named = next((raw["processor_class"] for raw in saved if raw.get("processor_class")), None)
    if named in OWN_PROCESSORS:
        return OWN_PROCESSORS[named](Path(folder))
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(folder), local_files_only=True)


def geometry_of(hf_config: Any, folder: str | Path | None, image_size: int | None = None) -> tuple[int, int] | None:
    """(S, N) of a vision-language checkpoint: its config, and the processor's files in ``folder`` (if any);
    ``image_size`` (model.image_size) chooses S where the processor takes a range of sizes (None: it takes a range
    and none was chosen: the text decoder exports alone)."""
    family = vision_language_of(hf_config)
    assert family is not None and family.geometry is not None, "a vision-language config whose encoder is built"
    processor = processor_settings(Path(folder)) if folder is not None else {}
    if family.size_chosen:
        return family.geometry(hf_config, processor, image_size)  # type: ignore[call-arg]
    side, tokens = family.geometry(hf_config, processor)
    if image_size is not None and image_size != side:
        raise ModelError(f"model.image_size={image_size}: {hf_config.architectures[0]}'s images are {side} x {side} "
                         "(its processor and config fix them); model.image_size chooses the size for Qwen-VL "
                         "checkpoints, whose processors take a range. Leave it unset.")
    return side, tokens


def vision_language_of(hf_config: Any) -> VisionLanguage | None:
    """The vision-language architecture of ``config.json``, or None for a text checkpoint."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    return next((v for v in VISION_LANGUAGE for arch in archs if arch in v.architectures), None)


def text_only(hf_config: Any, folder: str | Path | None = None, image_size: int | None = None) -> str | None:
    """What the console says of a vision-language checkpoint whose vision encoder is not exported (not built, or its
    image size not chosen: ``folder``'s processor, ``image_size``); None otherwise."""
    family = vision_language_of(hf_config)
    if family is None or getattr(hf_config, "vision_config", None) is None:  # Gemma 4 without an image tower
        return None
    if family.geometry is None:
        return f"text decoder only ({hf_config.architectures[0]}'s vision encoder is not exported yet)"
    if family.size_chosen and geometry_of(hf_config, folder, image_size) is None:
        return f"text decoder only ({size_to_choose(hf_config)})"
    return None
