"""Validation of a vision-language program's image path: what the text windows cannot reach.

One seeded image goes through ``vision_encoder`` (against the eager encoder: largest error, least cosine per
position), then an image prompt (text, the image's positions, text) through ``token_embedding`` and
``text_decoder`` as ExecuTorch's MultimodalRunner calls them, and greedy steps after it, against the eager decoder
on the same embeddings (KL at the prompt's last position and at each step, on the program's tokens).
"""

from __future__ import annotations

import torch

from exporters.manifest import VisionCheck
from exporters.program.vision import VISION_METHOD
from exporters.runtime.driver import RunsMethods
from exporters.runtime.quality import Agreement
from models.decoder import CausalLM
from models.vision_encoder import VisionEncoder

GREEDY_STEPS = 8
MIN_COSINE = 0.99  # each image position's embedding, program against eager (fp32 gives 1 - 1e-7)
IMAGE = "seeded uniform pixels in [-1, 1]"


def test_image(size: int, seed: int = 0) -> torch.Tensor:
    """A deterministic image as the processor gives it: [1, 3, size, size] normalized pixels."""
    return torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _program_step(program: RunsMethods, embed: str, decoder: str, tokens: torch.Tensor, start: int) -> torch.Tensor:
    return program.run(decoder, program.run(embed, tokens)[0], torch.tensor([start]))[0].reshape(1, -1)


def check_image_path(program: RunsMethods, model: CausalLM, encoder: VisionEncoder, before: torch.Tensor,
                     after: torch.Tensor, max_kl: float, embed: str = "token_embedding",
                     decoder: str = "text_decoder") -> VisionCheck:
    """``before`` [1, B] and ``after`` [1, A]: the text around the image. The program's caches are overwritten from
    position 0; the eager model's are reset first and after."""
    pixels = test_image(encoder.image_size)
    with torch.no_grad():
        ours_image = program.run(VISION_METHOD, pixels)[0]
        eager_image = encoder(pixels)
        error = float((ours_image.float() - eager_image.float()).abs().max())
        cosine = float(torch.nn.functional.cosine_similarity(ours_image[0].float(), eager_image[0].float(),
                                                             dim=-1).min())
        n = ours_image.shape[1]
        # The program, as the MultimodalRunner drives it: text, then the image, then text, each in one call, each
        # method's output given to the next as it is (the runner converts nothing).
        _program_step(program, embed, decoder, before, 0)
        program.run(decoder, ours_image, torch.tensor([before.shape[1]]))
        start = before.shape[1] + n
        ours = [_program_step(program, embed, decoder, after, start)]
        # The eager decoder on the same prompt, the image's embeddings its own encoder's.
        model.reset_cache()
        embeddings = torch.cat([model.token_embeddings(before), eager_image.to(model.activation_dtype()),
                                model.token_embeddings(after)], dim=1)
        eager = [model(embeddings, torch.tensor([0])).float().reshape(1, -1)]
        tokens, eager_tokens, position = [], [], embeddings.shape[1]
        for _ in range(GREEDY_STEPS):
            token = int(ours[-1].argmax())
            tokens.append(token)
            eager_tokens.append(int(eager[-1].argmax()))
            step = torch.tensor([[token]])
            ours.append(_program_step(program, embed, decoder, step, position))
            eager.append(model(step, torch.tensor([position])).float().reshape(1, -1))
            position += 1
        model.reset_cache()
    kl = float(Agreement.of(torch.cat(eager), torch.cat(ours).float()).kl.max())
    failures = [*([f"image embeddings: least cosine {cosine:.4f} < {MIN_COSINE}"] if cosine < MIN_COSINE else []),
                *([f"image prompt: KL {kl:.3g} > {max_kl:.3g}"] if kl > max_kl else [])]
    return VisionCheck(passed=not failures, failures=failures, image=IMAGE, max_abs_error=error, cosine=cosine,
                       prompt_tokens=start + after.shape[1], kl_max=kl, greedy_tokens=tokens,
                       eager_choices=eager_tokens, tolerance={"max_kl": max_kl, "min_cosine": MIN_COSINE})
