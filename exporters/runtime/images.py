"""Prompts with images for a vision-language program, made by the checkpoint's own processor (saved in the run).

The processor resizes and normalizes each picture and writes the image's tokens into the prompt; the prompt is then
fed as ExecuTorch's MultimodalRunner feeds it: each text segment through ``token_embedding`` then ``text_decoder``,
each image through ``vision_encoder`` then ``text_decoder``, at consecutive positions (an image takes as many
positions as ``vision_encoder`` gives embeddings). Every mismatch is refused before any method runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exporters.errors import UserError
from exporters.program.vision import (IMAGE_SIZE, IMAGE_TOKEN_ID, IMAGE_TOKENS, VISION_METHOD, program_pixels,
                                      prompt_marker)
from exporters.runtime.driver import Driver, MethodRoles, RunsMethods
from models.lfm2_vl_images import Lfm2VlSquareImages
from models.vision import load_processor

log = logging.getLogger("exporters")


@dataclass(frozen=True)
class ImagePrompt:
    ids: list[int]  # the prompt's tokens, each image's positions as the image token
    parts: list[torch.Tensor]  # in order: token ids [1, T], or one image's pixels [1, 3, S, S]


def _open_image(path: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise UserError(f"image={path}: cannot be read as an image ({e}). Give a PNG or JPEG file.") from None


def image_prompt(program: Any, folder: Path, prompt: str, images: list[str], chat: bool) -> ImagePrompt:
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
        return ImagePrompt(ids, [torch.tensor([ids])])
    pixels = program_pixels(out, size)
    if tuple(pixels.shape[-2:]) != (size, size):
        raise UserError(f"the processor made {tuple(pixels.shape[-2:])} images and the program's vision_encoder takes "
                        f"{size}x{size} (get_image_size): the processor files beside the program are not the ones it "
                        "was exported with. Export again, or restore the run folder's processor_config.json.")
    return ImagePrompt(ids, _parts(ids, pixels, image_token, per_image))


def _say_stretched(processor: Any, paths: list[str], pictures: list[Any], size: int) -> None:
    """LFM2-VL's processor here makes one S x S image of every picture (the program's one shape): a picture of another
    aspect ratio is stretched, which the console says (transformers' own processor would keep the ratio, in tiles)."""

    if not isinstance(processor.image_processor, Lfm2VlSquareImages):
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


def prefill_parts(program: RunsMethods, roles: MethodRoles, parts: list[torch.Tensor]) -> torch.Tensor:
    """The prompt's last logits [1, V] after each part at consecutive positions: images through vision_encoder, text
    through ``roles`` (token_embedding and text_decoder, in calls of at most ``roles.prompt_max_tokens``)."""
    driver, position, logits = Driver(program, roles), 0, None
    for part in parts:
        if part.is_floating_point():
            embeddings = program.run(VISION_METHOD, part)[0]
            logits = program.run(roles.prompt, embeddings, torch.tensor([position]))[0]
            position += embeddings.shape[1]
        else:
            logits = driver.prefill(part, position)
            position += part.shape[1]
    assert logits is not None, "a prompt has at least one part"
    return logits.reshape(-1, logits.shape[-1])[-1:]
