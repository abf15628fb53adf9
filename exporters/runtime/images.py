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
    try:
        return open_picture(Path(path))
    except UserError as e:
        raise UserError(f"image={path}: {e}") from None


def open_picture(source: Path | bytes) -> Any:
    """A file's or bytes' picture as RGB; anything PIL cannot read is a UserError."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise UserError(f"cannot be read as an image ({e}). Give a PNG or JPEG.") from None


def image_prompt(program: Any, folder: Path, prompt: str, images: list[str], chat: bool) -> MediaPrompt:
    """``prompt`` with ``images`` (files), through the processor beside the program; ``chat``: the chat template
    places the images before the text (else the prompt must mark where each goes)."""
    check_sees_images(program)
    processor = load_processor(folder)
    pictures = [_open_image(path) for path in images]
    _say_stretched(processor, images, pictures, int(program.constant(IMAGE_SIZE)))
    if chat:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        return conversation_prompt(program, processor, folder, [{"role": "user", "content": content}], pictures)
    return marked_prompt(program, processor, prompt, pictures)


def seen_around(program: Any, folder: Path, head: str, tail: str, images: list[str]) -> tuple[MediaPrompt, MediaPrompt]:
    """The text before another medium (a recording) and the text after it, each with the images its marks take in
    order, through the processor (which refuses a medium it is not given, so each side goes alone); the second
    side's BOS dropped: one prompt."""
    processor = load_processor(folder)
    pictures = [_open_image(path) for path in images]
    _say_stretched(processor, images, pictures, int(program.constant(IMAGE_SIZE)))
    marker = prompt_marker(processor)
    first = head.count(marker)
    if first + tail.count(marker) != len(pictures):
        marked_prompt(program, processor, head + tail, pictures)  # refuses in the one-medium prompt's words
    before = marked_prompt(program, processor, head, pictures[:first])
    after = marked_prompt(program, processor, tail, pictures[first:])
    bos = processor.tokenizer.bos_token_id
    if after.ids[:1] == [bos] and bos is not None:
        rest = after.parts[0][:, 1:]  # the first part is text: it holds the BOS
        after = MediaPrompt(after.ids[1:], ([rest] if rest.numel() else []) + after.parts[1:], after.encoders)
    return before, after


def check_sees_images(program: Any) -> None:
    if VISION_METHOD not in program.method_names:
        raise UserError(f"image= needs a vision-language program, and {program.path} has no {VISION_METHOD} method: "
                        "export a vision-language checkpoint (LLaVA, Gemma 3, SmolVLM / Idefics3, LFM2-VL, Qwen-VL, "
                        "Gemma 4), or leave image out.")


def conversation_prompt(program: Any, processor: Any, folder: Path, messages: list[dict[str, Any]],
                        pictures: list[Any]) -> MediaPrompt:
    """A conversation whose content parts are text and ``{"type": "image"}`` (one per picture, in order), through the
    processor's chat template."""
    if not getattr(processor, "chat_template", None):
        raise UserError(f"a chat with images needs the processor's chat template, and {folder} has none (this "
                        f"checkpoint was saved without one): write {prompt_marker(processor)!r} where each image goes in "
                        "a prompt instead (chat=false, or a text completion).")
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return marked_prompt(program, processor, prompt, pictures)


def marked_prompt(program: Any, processor: Any, prompt: str, pictures: list[Any]) -> MediaPrompt:
    """``prompt``, whose image markers take ``pictures`` in order, as the program's parts."""
    size, per_image = int(program.constant(IMAGE_SIZE)), int(program.constant(IMAGE_TOKENS))
    image_token = int(program.constant(IMAGE_TOKEN_ID))
    marker = prompt_marker(processor)
    marked = prompt.count(marker)
    if marked != len(pictures):
        raise UserError(
            f"the prompt marks {marked} image(s) with {marker!r} and {len(pictures)} image(s) are given: each "
            f"{marker!r} in the prompt takes one image, in order (chat=true places the marks for you); nothing "
            "was generated.")
    out = processor(images=pictures or None, text=prompt, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    if not pictures:
        return MediaPrompt.text(ids)
    pixels = program_pixels(out, size)
    if tuple(pixels.shape[-2:]) != (size, size):
        raise UserError(f"the processor made {tuple(pixels.shape[-2:])} images and the program's vision_encoder takes "
                        f"{size}x{size} (get_image_size): the processor files beside the program are not the ones it "
                        "was exported with. Export again, or restore the run folder's processor_config.json.")
    return MediaPrompt.of(ids, _parts(ids, pixels, image_token, per_image), VISION_METHOD)


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
