"""LFM2-VL's image processor for a program of one fixed square: transformers' PIL SigLIP2 processor, one S x S image.

transformers' only LFM2-VL image processor (``Lfm2VlImageProcessor``) is written on torchvision, and PyPI's torchvision
for torch 2.13 cannot load beside the CPU build of torch this project pins (``operator torchvision::nms does not
exist``). LFM2-VL's tower is SigLIP2 (NaFlex), whose PIL processor transformers ships (``Siglip2ImageProcessorPil``):
for an S x S image, with neither tiling nor a token budget to meet, both write the same thing (resize to the same
size, rescale, normalize, patch rows with the channel fastest, a mask of ones, ``spatial_shapes`` ``(S/p, S/p)``).
This class is that processor with the fields of LFM2-VL's saved ``processor_config.json`` and the row and column
counts ``Lfm2VlProcessor`` reads to write the image's tokens; every picture is first resized to S x S (the program's
one shape; a picture of another aspect ratio is stretched, which LFM2-VL was not trained on: docs/vision.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from transformers.image_utils import SizeDict
from transformers.models.siglip2.image_processing_pil_siglip2 import (Siglip2ImageProcessorKwargs,
                                                                      Siglip2ImageProcessorPil)

from models.processor_files import saved_processor_parts

# LFM2-VL's processor fields and their defaults (Lfm2VlImageProcessor's in transformers 5.23): kept as saved, read
# for N (max_image_tokens), p (encoder_patch_size) and f (downsample_factor); the tiling ones do nothing here.
LFM2_VL_DEFAULTS: dict[str, Any] = {"downsample_factor": 2, "do_image_splitting": True, "min_tiles": 2, "max_tiles": 10,
                                    "use_thumbnail": True, "min_image_tokens": 64, "max_image_tokens": 256,
                                    "encoder_patch_size": 16, "tile_size": 512, "max_pixels_tolerance": 2.0}


class Lfm2VlImagesKwargs(Siglip2ImageProcessorKwargs, total=False):
    downsample_factor: int
    do_image_splitting: bool
    min_tiles: int
    max_tiles: int
    use_thumbnail: bool
    min_image_tokens: int
    max_image_tokens: int
    encoder_patch_size: int
    tile_size: int
    max_pixels_tolerance: float
    do_pad: bool
    return_row_col_info: bool


def square_side(settings: dict[str, Any]) -> tuple[int, int]:
    """(S, N) of LFM2-VL's processor ``settings``: N = ``max_image_tokens`` positions per image, a square grid of
    sqrt(N) x sqrt(N) after the projector's pixel unshuffle by ``downsample_factor`` f, so S = p * f * sqrt(N)."""
    merged = {**LFM2_VL_DEFAULTS, **settings}
    tokens, p, f = int(merged["max_image_tokens"]), int(merged["encoder_patch_size"]), int(merged["downsample_factor"])
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(f"max_image_tokens={tokens} is not a square: a program of one square image takes a square "
                         "number of positions (64, 256, ...)")
    return p * f * side, tokens


class Lfm2VlSquareImages(Siglip2ImageProcessorPil):
    """``Lfm2VlProcessor``'s image processor for one S x S image per picture (no tiles, no thumbnail)."""

    valid_kwargs = Lfm2VlImagesKwargs
    stretches_to_square = True  # read by exporters.runtime.images without importing this module (transformers' PIL
    # image processors take about 5 s to import: every text generation would pay it)

    def __init__(self, **kwargs: Any) -> None:
        lfm2 = {key: kwargs.pop(key, value) for key, value in LFM2_VL_DEFAULTS.items()}
        for key in ("do_pad", "return_row_col_info", "size", "image_processor_type", "processor_class"):
            kwargs.pop(key, None)
        super().__init__(**kwargs)
        for key, value in lfm2.items():
            setattr(self, key, value)
        self.side, self.tokens = square_side(lfm2)
        self.patch_size = self.encoder_patch_size
        self.max_num_patches = (self.side // self.patch_size) ** 2

    def to_dict(self) -> dict[str, Any]:
        """Saved as transformers' own class saves (a checkpoint written with this loads with
        ``Lfm2VlImageProcessor`` where torchvision is installed)."""
        saved = super().to_dict()
        saved["image_processor_type"] = "Lfm2VlImageProcessor"
        for key in ("patch_size", "side", "tokens"):
            saved.pop(key, None)
        return saved

    def _preprocess(self, images: list[Any], return_row_col_info: bool = False, **kwargs: Any) -> Any:
        square = SizeDict(height=self.side, width=self.side)
        images = [image if tuple(image.shape[-2:]) == (self.side, self.side)
                  else self.resize(image=image, size=square, resample=kwargs["resample"]) for image in images]
        kwargs.update(do_resize=False, patch_size=self.patch_size, max_num_patches=self.max_num_patches)
        out = super()._preprocess(images, **kwargs)
        if return_row_col_info:  # what Lfm2VlProcessor reads to write each image's tokens: one tile of S x S
            out["image_rows"] = [1] * len(images)
            out["image_cols"] = [1] * len(images)
            out["image_sizes"] = [[self.side, self.side]] * len(images)
        return out


def lfm2_vl_processor(folder: Path) -> Any:
    """``Lfm2VlProcessor`` of the checkpoint ``folder`` (its tokenizer, image tokens and chat template) with
    :class:`Lfm2VlSquareImages` in place of the torchvision image processor."""
    from transformers import Lfm2VlProcessor

    settings, tokenizer, chat_template = saved_processor_parts(folder)
    return Lfm2VlProcessor(Lfm2VlSquareImages(**settings), tokenizer, chat_template=chat_template)
