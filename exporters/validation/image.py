"""Validation of a vision-language program's image path: what the text windows cannot reach.

One seeded image goes through ``vision_encoder`` (against the eager encoder: largest error, least cosine per
position), then an image prompt (text, the image's positions, text) through ``token_embedding`` and
``text_decoder`` as ExecuTorch's MultimodalRunner calls them, and greedy steps after it, against the eager decoder
on the same embeddings (KL at the prompt's last position and at each step, on the program's tokens). Beside that
pass/fail check, what quantization cost the image path: the same prompt through the unquantized encoder and decoder
(recorded by the baseline stage, :func:`unquantized_image_path`) against the program on the same tokens, and the
quantized encoder's embeddings against the unquantized one's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exporters.manifest import ImageQuality, VisionCheck
from exporters.program.vision import VISION_METHOD
from exporters.runtime.driver import RunsMethods
from exporters.runtime.quality import Agreement
from models.decoder import CausalLM
from models.vision_encoder import VisionEncoder

GREEDY_STEPS = 8
MIN_COSINE = 0.99  # each image position's embedding, program against eager (fp32 gives 1 - 1e-7)
IMAGE = "seeded uniform pixels in [-1, 1]"
IMAGE_PROMPT_TEXT = 8  # tokens of the validation text before the image, and as many after it
EMBED, DECODER = "token_embedding", "text_decoder"  # the methods the MultimodalRunner feeds text and images to


@dataclass(frozen=True)
class ImageBaseline:
    """The image prompt through the unquantized encoder and decoder, before quantization changes them."""

    features: torch.Tensor  # [1, N, hidden]: the unquantized encoder's embeddings of the test image
    logits: torch.Tensor  # [1 + GREEDY_STEPS, V]: at the prompt's last position, then after each of its tokens
    tokens: list[int]  # the unquantized model's greedy tokens


def image_prompt_text(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The text before and after the image: the first validation window's first tokens."""
    half = min(IMAGE_PROMPT_TEXT, window.shape[1] // 2)
    return window[:, :half], window[:, half:2 * half]


def _eager_image_prompt(model: CausalLM, image: torch.Tensor, before: torch.Tensor, after: torch.Tensor,
                        tokens: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """The eager decoder's logits [1 + GREEDY_STEPS, V] on text, the image's embeddings, text and then ``tokens``
    (None: its own greedy choices), and the tokens it was given or chose. Resets the caches before and after."""
    model.reset_cache()
    embeddings = torch.cat([model.token_embeddings(before), image.to(model.activation_dtype()),
                            model.token_embeddings(after)], dim=1)
    logits = [model(embeddings, torch.tensor([0])).float().reshape(1, -1)]
    chosen, position = [], embeddings.shape[1]
    for step in range(GREEDY_STEPS):
        token = int(logits[-1].argmax()) if tokens is None else tokens[step]
        chosen.append(token)
        logits.append(model(torch.tensor([[token]]), torch.tensor([position])).float().reshape(1, -1))
        position += 1
    model.reset_cache()
    return torch.cat(logits), chosen


def unquantized_image_path(model: CausalLM, encoder: VisionEncoder, window: torch.Tensor) -> ImageBaseline:
    """The baseline stage's image prompt, through the models as loaded."""
    before, after = image_prompt_text(window)
    with torch.no_grad():
        features = encoder(test_image(encoder.image_size)).float()
        logits, tokens = _eager_image_prompt(model, features, before, after)
    return ImageBaseline(features, logits, tokens)


def test_image(size: int, seed: int = 0) -> torch.Tensor:
    """A deterministic image as the processor gives it: [1, 3, size, size] normalized pixels."""
    return torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _program_step(program: RunsMethods, tokens: torch.Tensor, start: int) -> torch.Tensor:
    return program.run(DECODER, program.run(EMBED, tokens)[0], torch.tensor([start]))[0].reshape(1, -1)


def check_image_path(program: RunsMethods, model: CausalLM, encoder: VisionEncoder, window: torch.Tensor,
                     max_kl: float, baseline: ImageBaseline | None = None) -> VisionCheck:
    """The image prompt around the first validation ``window``'s text. The program's caches are overwritten from
    position 0; the eager model's are reset first and after."""
    before, after = image_prompt_text(window)
    pixels = test_image(encoder.image_size)
    with torch.no_grad():
        ours_image = program.run(VISION_METHOD, pixels)[0]
        eager_image = encoder(pixels)
        error = float((ours_image.float() - eager_image.float()).abs().max())
        cosine = _least_cosine(ours_image, eager_image)
        start = before.shape[1] + ours_image.shape[1]
        ours = torch.cat(_program_image_prompt(program, ours_image, before, after)).float()
        tokens = [int(row.argmax()) for row in ours[:-1]]
        eager, _ = _eager_image_prompt(model, eager_image, before, after, tokens)
        eager_choices = [int(row.argmax()) for row in eager[:-1]]
        quality = None
        if baseline is not None:  # the program on the unquantized model's tokens, against it
            theirs = torch.cat(_program_image_prompt(program, ours_image, before, after,
                                                     baseline.tokens))
            agreement = Agreement.of(baseline.logits, theirs.float())
            quality = ImageQuality(encoder_cosine=_least_cosine(eager_image, baseline.features),
                                   kl_mean=float(agreement.kl.mean()), kl_max=float(agreement.kl.max()),
                                   top1=float(agreement.top1.float().mean()))
    kl = float(Agreement.of(eager, ours).kl.max())
    failures = [*([f"image embeddings: least cosine {cosine:.4f} < {MIN_COSINE}"] if cosine < MIN_COSINE else []),
                *([f"image prompt: KL {kl:.3g} > {max_kl:.3g}"] if kl > max_kl else [])]
    return VisionCheck(passed=not failures, failures=failures, image=IMAGE, max_abs_error=error, cosine=cosine,
                       prompt_tokens=start + after.shape[1], kl_max=kl, greedy_tokens=tokens,
                       eager_choices=eager_choices, tolerance={"max_kl": max_kl, "min_cosine": MIN_COSINE},
                       unquantized=quality)


def _least_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The least cosine similarity of one image position's embedding between ``a`` and ``b`` ([1, N, hidden]); equal
    embeddings count as 1, zero ones included (a projector of zeros: torch's cosine of two zero vectors is 0)."""
    a, b = a[0].float(), b[0].float()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return float(torch.where((a == b).all(dim=-1), torch.ones_like(cosine), cosine).min())


def _program_image_prompt(program: RunsMethods, image: torch.Tensor, before: torch.Tensor,
                          after: torch.Tensor, tokens: list[int] | None = None) -> list[torch.Tensor]:
    """The program as the MultimodalRunner drives it (text, the image, text, each in one call; each method's output
    given to the next as it is), then GREEDY_STEPS tokens (``tokens``, else its own greedy choices): the logits
    [1, V] after the prompt and after each token, GREEDY_STEPS + 1 of them."""
    _program_step(program, before, 0)
    program.run(DECODER, image, torch.tensor([before.shape[1]]))
    position = before.shape[1] + image.shape[1]
    logits = [_program_step(program, after, position)]
    position += after.shape[1]
    for step in range(GREEDY_STEPS):
        token = int(logits[-1].argmax()) if tokens is None else tokens[step]
        logits.append(_program_step(program, torch.tensor([[token]]), position))
        position += 1
    return logits
