"""Gemma 4's processor for a program of one fixed square image, without torchvision.

transformers' ``Gemma4Processor`` insists on a video processor (torchvision, not installable beside the CPU torch
this project pins) and an audio feature extractor. Images need neither: :func:`images_only` takes an image
processor and a tokenizer alone, expanding ``<|image|>`` into the image's tokens as it does.
:class:`Gemma4SquareImages` is transformers' PIL ``Gemma4ImageProcessorPil`` with every picture resized to the
program's S x S (its ``size``; without one, the largest square within the processor's ``max_soft_tokens``): its
patch rows are one whole S x S grid (then padding rows, as transformers pads them), which
``exporters.program.vision.program_pixels`` folds back into the ``[1, 3, S, S]`` the program takes. A picture of
another aspect ratio is stretched, where transformers would keep its ratio (docs/vision.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from transformers.image_transforms import resize
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from models.processor_files import saved_processor_parts


def square_side(max_soft_tokens: int, patch_size: int, pooling_kernel_size: int) -> int:
    """The largest square whose pooled positions fit ``max_soft_tokens`` (280 at 16 px patches pooled 3 x 3: 768)."""
    return math.isqrt(max_soft_tokens) * pooling_kernel_size * patch_size


def program_side(size: Any, max_soft_tokens: int, patch_size: int, pooling_kernel_size: int) -> int:
    """S of the program's square: the processor's ``size`` where it is a square of whole pooled cells (a run's files,
    written by ``exporters.components.vision.processor_files_sized``), else the largest square within its budget.
    transformers' own processor ignores ``size``, and some published copies carry a stale one (224 x 224, SigLIP's):
    read as S it would cut no whole cells, so it is not."""
    height = size.get("height") if isinstance(size, dict) else getattr(size, "height", None)
    width = size.get("width") if isinstance(size, dict) else getattr(size, "width", None)
    unit = patch_size * pooling_kernel_size
    if height and height == width and height % unit == 0:
        return int(height)
    return square_side(max_soft_tokens, patch_size, pooling_kernel_size)


class Gemma4SquareImages(Gemma4ImageProcessorPil):
    """Every picture resized to S x S, then rescaled and cut into rows as transformers does."""

    stretches_to_square = True  # read by exporters.runtime.images without importing this module

    def side(self) -> int:
        return program_side(getattr(self, "size", None), self.max_soft_tokens, self.patch_size,
                            self.pooling_kernel_size)

    def aspect_ratio_preserving_resize(self, image: np.ndarray, patch_size: int, max_patches: int,
                                       pooling_kernel_size: int, resample: Any) -> np.ndarray:
        s = self.side()
        return image if tuple(image.shape[-2:]) == (s, s) else resize(image, size=(s, s), resample=resample)

    def to_dict(self) -> dict[str, Any]:
        """Saved as transformers' own class saves."""
        fields = super().to_dict()
        fields["image_processor_type"] = "Gemma4ImageProcessor"
        return fields


def images_only() -> type:
    """transformers' ``Gemma4Processor`` taking an image processor and a tokenizer, no audio or video processor."""
    from transformers import Gemma4Processor
    from transformers.processing_utils import ProcessorMixin

    class _NoneAllowed(ProcessorMixin):
        """ProcessorMixin refuses a None feature extractor or video processor; Gemma4Processor passes both on."""

        def __init__(self, *args: Any, feature_extractor: Any = None, video_processor: Any = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.feature_extractor = self.video_processor = None

    class ImagesOnly(Gemma4Processor, _NoneAllowed):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                     **kwargs: Any) -> None:
            Gemma4Processor.__init__(self, None, image_processor, tokenizer, None, chat_template=chat_template,
                                     **kwargs)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = "Gemma4Processor"  # saved under transformers' own name
    return ImagesOnly


def gemma4_processor(folder: Path) -> Any:
    """The processor saved in ``folder`` (a checkpoint or a run), for images and text."""
    settings, tokenizer, chat_template = saved_processor_parts(folder)
    return images_only()(Gemma4SquareImages(**settings), tokenizer, chat_template=chat_template)
