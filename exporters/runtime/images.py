"""Prompts with images for a vision-language program, made by the checkpoint's own processor (saved in the run).

The processor resizes and normalizes each picture and writes the image's tokens into the prompt; the prompt is then
fed as ExecuTorch's MultimodalRunner feeds it (``exporters.runtime.media``). Every mismatch is refused before any
method runs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from exporters.errors import UserError
from exporters.program.vision import (IMAGE_SIZE, IMAGE_TOKEN_ID, IMAGE_TOKENS, VISION_METHOD, program_pixels,
                                      prompt_marker)
from exporters.runtime.media import MediaPrompt
from models.vision import load_processor

log = logging.getLogger("exporters")


def _open_image(path: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise UserError(f"image={path}: cannot be read as an image ({e}). Give a PNG or JPEG file.") from None


def image_prompt(program: Any, folder: Path, prompt: str, images: list[str], chat: bool) -> MediaPrompt:
    """``prompt`` with ``images`` (files), through the processor beside the program; ``chat``: the chat template
    places the images before the text (else the prompt must mark where each goes)."""
    names = program.method_names
    if VISION_METHOD not in names:
        raise UserError(f"image= needs a vision-language program, and {program.path} has no {VISION_METHOD} method: "
                        "export a vision-language checkpoint (LLaVA, Gemma 3, SmolVLM / Idefics3, LFM2-VL), or leave image "
                        "out.")
    size, per_image = int(program.constant(IMAGE_SIZE)), int(program.constant(IMAGE_TOKENS))
    image_token = int(program.constant(IMAGE_TOKEN_ID))
    processor = load_processor(folder)
    marker = prompt_marker(processor)
    pictures = [_open_image(path) for path in images]
    _say_stretched(processor, images, pictures, size)
    if chat and not getattr(processor, "chat_template", None):
        raise UserError(f"chat=true needs the processor's chat template, and {folder} has none (this checkpoint was "
                        f"saved without one): use chat=false and write {marker!r} where each image goes.")
    if chat:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                               tokenize=False)
    marked = prompt.count(marker)
    if marked != len(images):
        raise UserError(
            f"the prompt marks {marked} image(s) with {marker!r} and {len(images)} image= file(s) are given: each "
            f"{marker!r} in the prompt takes one image= file, in order (chat=true places the marks for you); nothing "
            "was generated.")
    out = processor(images=pictures or None, text=prompt, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    if not images:
        return MediaPrompt(ids, [torch.tensor([ids])], VISION_METHOD)
    pixels = program_pixels(out, size)
    if tuple(pixels.shape[-2:]) != (size, size):
        raise UserError(f"the processor made {tuple(pixels.shape[-2:])} images and the program's vision_encoder takes "
                        f"{size}x{size} (get_image_size): the processor files beside the program are not the ones it "
                        "was exported with. Export again, or restore the run folder's processor_config.json.")
    return MediaPrompt(ids, _parts(ids, pixels, image_token, per_image), VISION_METHOD)


def _say_stretched(processor: Any, paths: list[str], pictures: list[Any], size: int) -> None:
    """LFM2-VL's processor here makes one S x S image of every picture (the program's one shape): a picture of another
    aspect ratio is stretched, which the console says (transformers' own processor would keep the ratio, in tiles)."""

    if not getattr(processor.image_processor, "stretches_to_square", False):  # models.lfm2_vl_images' processor
        return
    for path, picture in zip(paths, pictures):
        width, height = picture.size
        if width != height:
            log.info("image=%s is %dx%d; the program takes %dx%d images: stretched to it (its aspect ratio is lost: "
                     "crop it square first to keep it)", path, width, height, size, size)


def _parts(ids: list[int], pixels: torch.Tensor, image_token: int, per_image: int) -> list[torch.Tensor]:
    """Text segments and images in prompt order: each run of image tokens is one or more whole images."""
    parts: list[torch.Tensor] = []
    text: list[int] = []
    run, images = 0, iter(pixels)
    for token in [*ids, None]:
        if token == image_token:
            run += 1
            continue
        if run:
            if run % per_image:
                raise UserError(f"the prompt has a run of {run} image tokens, not a multiple of the {per_image} "
                                "positions an image takes here: the processor and the program disagree. Export again.")
            if text:
                parts.append(torch.tensor([text]))
                text = []
            for _ in range(run // per_image):
                image = next(images, None)
                if image is None:
                    raise UserError("the prompt has more image tokens than the processor made images.")
                parts.append(image.unsqueeze(0))
            run = 0
        if token is not None:
            text.append(token)
    if text:
        parts.append(torch.tensor([text]))
    return parts
