"""Validation of a vision-language program's image path: one seeded image through ``vision_encoder`` and an image
prompt through ``text_decoder``, against the eager models (``exporters.validation.encoder_prompt`` does the work)."""

from __future__ import annotations

import torch

from exporters.manifest import VisionCheck
from exporters.program.vision import VISION_METHOD
from exporters.runtime.driver import RunsMethods
from exporters.validation.encoder_prompt import EncoderBaseline, check_encoder_path, unquantized_path
from models.decoder import CausalLM
from models.vision_encoder import VisionEncoder

IMAGE = "seeded uniform pixels in [-1, 1]"


def test_image(size: int, seed: int = 0) -> torch.Tensor:
    """A deterministic image as the processor gives it: [1, 3, size, size] normalized pixels."""
    return torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def unquantized_image_path(model: CausalLM, encoder: VisionEncoder, window: torch.Tensor) -> EncoderBaseline:
    """The baseline stage's image prompt, through the models as loaded."""
    return unquantized_path(model, encoder, test_image(encoder.image_size), window)


def check_image_path(program: RunsMethods, model: CausalLM, encoder: VisionEncoder, window: torch.Tensor,
                     max_kl: float, baseline: EncoderBaseline | None = None) -> VisionCheck:
    """The image prompt around the first validation ``window``'s text."""
    return VisionCheck(image=IMAGE, **check_encoder_path(program, VISION_METHOD, test_image(encoder.image_size), model,
                                                         encoder, window, max_kl, baseline))
