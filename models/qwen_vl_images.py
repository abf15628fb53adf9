"""Qwen2.5-VL's and Qwen3-VL's processors for a program of one fixed square image, without torchvision.

transformers' ``Qwen2_5_VLProcessor`` and ``Qwen3VLProcessor`` insist on a video processor, which needs torchvision
(not installable beside the CPU torch this project pins). Images need none: :func:`images_only` makes each class
take an image processor and a tokenizer alone, expanding ``<|image_pad|>`` by the image's grid as it does.
:class:`QwenVlSquareImages` is transformers' PIL ``Qwen2VLImageProcessorPil`` with every picture resized to the
program's S x S (the processor's ``size``, shortest and longest edge both S * S pixels): its patch rows are one whole
S x S grid, which ``exporters.program.vision.program_pixels`` folds back into the ``[1, 3, S, S]`` the program takes.
A picture of another aspect ratio is stretched, which Qwen did not train on (docs/vision.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from transformers.image_utils import SizeDict
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from models.processor_files import saved_processor_parts


class QwenVlSquareImages(Qwen2VLImageProcessorPil):
    """Every picture resized to S x S, then rescaled, normalized and cut into rows as transformers does."""

    stretches_to_square = True  # read by exporters.runtime.images without importing this module

    def resize(self, image: Any, size: SizeDict, resample: Any, factor: int, **kwargs: Any) -> Any:
        side = math.isqrt(int(size.longest_edge))
        return super(Qwen2VLImageProcessorPil, self).resize(image=image, size=SizeDict(height=side, width=side),
                                                            resample=resample)

    def to_dict(self) -> dict[str, Any]:
        """Saved as transformers' own class saves."""
        fields = super().to_dict()
        fields["image_processor_type"] = "Qwen2VLImageProcessor"
        return fields


def images_only(base: type) -> type:
    """``base`` (a Qwen-VL processor class) taking an image processor and a tokenizer, no video processor."""

    class ImagesOnly(base):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                     **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = base.__name__  # saved under transformers' own name
    return ImagesOnly


def qwen_vl_processor(folder: Path, processor_class: str) -> Any:
    """The processor saved in ``folder`` (a checkpoint or a run), for images and text."""
    import transformers

    settings, tokenizer, chat_template = saved_processor_parts(folder)
    return images_only(getattr(transformers, processor_class))(QwenVlSquareImages(**settings), tokenizer,
                                                               chat_template=chat_template)
