"""A vision encoder in the program: its method, its constants, its lowering pass, and an image as it takes it.

The kind itself (planning, building, quantizing, validating it) is ``exporters.components.vision``. Its method,
``vision_encoder``, takes one image of the processor's normalized pixels ``[1, 3, S, S]`` and gives ``[1, N, hidden]``
embeddings, which ExecuTorch's ``MultimodalRunner`` feeds to ``text_decoder``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exporters.errors import UserError
from exporters.program.methods import MethodSpec
from models.vision import PROCESSOR_FILES, processor_settings

VISION = "vision"  # the component's name (its buffers' prefix)
VISION_METHOD = "vision_encoder"  # the method ExecuTorch's MultimodalRunner calls for an image
# Our constant methods beside the runner's: what an app needs to turn a picture into the method's input.
IMAGE_SIZE, IMAGE_TOKENS, IMAGE_TOKEN_ID = "get_image_size", "get_image_tokens", "get_image_token_id"


@dataclass(frozen=True)
class VisionGeometry:
    """What the plan knows of the vision encoder from ``config.json`` alone."""

    family: str  # models.vision.VisionLanguage.name
    image_size: int  # S: every image is resized to S x S by the processor
    tokens: int  # N: embedding positions per image in the text decoder
    image_token_id: int  # the token each image position takes in a prompt (the config's)
    # The processor takes a range of sizes and the program S (Qwen-VL, Gemma 4): the run's processor files are sized
    # to it, their ``size`` field set to these items (models.vision.VisionLanguage.sized).
    size_chosen: bool = False
    size_field: tuple[tuple[str, int], ...] = ()
    # Each image token's place travels in the embedding (Qwen-VL's M-RoPE channels): a count a dtype must hold exactly.
    places_in_embedding: bool = False

    def sized(self) -> dict[str, int]:
        """The processor's ``size`` for the program's one square (Qwen-VL: least and most pixels both its area)."""
        return dict(self.size_field)


def vision_spec(geometry: VisionGeometry) -> MethodSpec:
    return MethodSpec(VISION_METHOD, geometry.tokens, geometry.tokens, False, takes="pixels", gives="embeddings",
                      image_size=geometry.image_size)


def vision_constants(geometry: VisionGeometry) -> dict[str, Any]:
    return {IMAGE_SIZE: geometry.image_size, IMAGE_TOKENS: geometry.tokens, IMAGE_TOKEN_ID: geometry.image_token_id}


def preprocessing(folder: Path) -> dict[str, Any]:
    """The processor's rescale factor, mean and std (and how it resizes), from its saved config: what an app does
    to a picture before vision_encoder."""
    settings = processor_settings(folder)
    return {key: settings[key] for key in ("rescale_factor", "image_mean", "image_std", "size", "resample",
                                           "do_image_splitting") if key in settings}


# Families whose processor writes patch rows (SigLIP2 NaFlex, Qwen-VL) where vision_encoder takes pixels: program_pixels.
PATCH_ROW_FAMILIES = ("lfm2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma4")
QWEN_MERGE = 2  # every Qwen-VL processor merges 2 x 2 patches into one position (its merge_size)


def _unrefused(rows: int, cols: int, patch: int, size: int, padded: bool = False) -> None:
    if padded:
        raise UserError(f"the processor padded an image's patches and the program's vision_encoder takes one whole "
                        f"{size}x{size} image (get_image_size): the processor files beside the program are not the "
                        "ones it was exported with. Export again, or restore the run folder's processor files.")
    if (rows * patch, cols * patch) != (size, size):
        raise UserError(f"the processor made a {rows * patch}x{cols * patch} image and the program's vision_encoder "
                        f"takes {size}x{size} (get_image_size): the processor files beside the program are not "
                        "the ones it was exported with. Export again, or restore the run folder's processor files.")


def _qwen_pixels(processed: Any, size: int) -> torch.Tensor:
    """Qwen-VL's rows ``[n * P, 3 * 2 * p^2]`` (each image's merge blocks row by row, each patch's two identical frames)
    folded back into ``[n, 3, S, S]``."""
    pixels, grids = processed["pixel_values"], processed["image_grid_thw"].tolist()
    patch = int(math.isqrt(pixels.shape[-1] // 6))
    for _, rows, cols in grids:
        _unrefused(rows, cols, patch, size)
    merge = QWEN_MERGE
    blocks = size // patch // merge
    return (pixels.reshape(-1, blocks, blocks, merge, merge, 3, 2, patch, patch)[:, :, :, :, :, :, 0]
            .permute(0, 5, 1, 3, 6, 2, 4, 7).reshape(-1, 3, size, size).contiguous())


def _gemma4_pixels(processed: Any, size: int) -> torch.Tensor:
    """Gemma 4's rows ``[n, rows, 3 p^2]`` (each patch's pixels row by row, channel fastest; the image's patches row by
    row, then padding rows at position (-1, -1)) folded back into ``[n, 3, S, S]``."""
    pixels, positions = processed["pixel_values"], processed["image_position_ids"]
    patch = int(math.isqrt(pixels.shape[-1] // 3))
    images = []
    for rows, where in zip(pixels, positions):
        kept = rows[(where >= 0).all(-1)]
        cols, lines = (int(where[..., i].max()) + 1 for i in (0, 1))
        _unrefused(lines, cols, patch, size)
        side = size // patch
        images.append(kept.reshape(side, side, patch, patch, 3).permute(4, 0, 2, 1, 3).reshape(3, size, size))
    return torch.stack(images).contiguous()


def program_pixels(processed: Any, size: int) -> torch.Tensor:
    """The images of a processor's output as ``vision_encoder`` takes them, ``[n, 3, S, S]``. A NaFlex processor
    (LFM2-VL's SigLIP2) writes patch rows ``[n, P, 3 p^2]`` with each image's patch grid, Qwen-VL's ``[n * P, 6 p^2]``
    with ``image_grid_thw``, Gemma 4's ``[n, rows, 3 p^2]`` with each row's position: one whole S x S image each is
    folded back into pixels; an image of any other grid cannot be fed to the program, and is refused."""
    pixels = processed["pixel_values"]
    if "image_grid_thw" in processed:
        return _qwen_pixels(processed, size)
    if "image_position_ids" in processed:
        return _gemma4_pixels(processed, size)
    if "spatial_shapes" not in processed:
        return pixels.reshape(-1, *pixels.shape[-3:])
    grids, mask = processed["spatial_shapes"].tolist(), processed["pixel_attention_mask"]
    patch = int(math.isqrt(pixels.shape[-1] // 3))
    side = size // patch
    for rows, cols in grids:
        _unrefused(rows, cols, patch, size, padded=not bool(mask.all()))
    return (pixels.reshape(-1, side, side, patch, patch, 3).permute(0, 5, 1, 3, 2, 4)
            .reshape(-1, 3, size, size).contiguous())


def has_processor(folder: Path) -> bool:
    """A random-weight shape (config.json alone) has no processor."""
    return any((folder / name).is_file() for name in PROCESSOR_FILES)


# Processors whose prompts mark an image with its begin-of-image token (which they expand), not the image token.
MARKED_BY_BOI = ("Gemma3Processor",)


def prompt_marker(processor: Any) -> str:
    """What a prompt writes where an image goes: Gemma 3's begin-of-image token, else the image token (Gemma 4's
    ``<|image|>``)."""
    if type(processor).__name__ in MARKED_BY_BOI:
        return processor.boi_token
    return processor.image_token


