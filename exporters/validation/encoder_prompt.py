"""Validation of an encoder's path into the text decoder (an image's, an audio's): what the text windows cannot reach.

One input goes through the encoder's method (``vision_encoder``, ``audio_encoder``) against the eager encoder
(largest error, least cosine per position), then a prompt (text, the encoder's embeddings, text) through
``token_embedding`` and ``text_decoder`` as ExecuTorch's MultimodalRunner calls them, and greedy steps after it,
against the eager decoder on the same embeddings (KL at the prompt's last position and at each step, on the program's
tokens). Beside that pass/fail check, what quantization cost the path: the same prompt through the unquantized encoder
and decoder (recorded by the baseline stage, :func:`unquantized_path`) against the program on the same tokens, and
the quantized encoder's embeddings against the unquantized one's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from exporters.manifest import PromptQuality
from exporters.runtime.driver import RunsMethods
from exporters.runtime.quality import Agreement
from models.decoder import CausalLM

GREEDY_STEPS = 8
MIN_COSINE = 0.99  # each position's embedding, program against eager (fp32 gives 1 - 1e-7)
PROMPT_TEXT = 8  # tokens of the validation text before the encoder's embeddings, and as many after them
EMBED, DECODER = "token_embedding", "text_decoder"  # the methods the MultimodalRunner feeds text and embeddings to


@dataclass(frozen=True)
class EncoderBaseline:
    """The prompt through the unquantized encoder and decoder, before quantization changes them."""

    features: torch.Tensor  # [1, N, hidden]: the unquantized encoder's embeddings of the test input
    logits: torch.Tensor  # [1 + GREEDY_STEPS, V]: at the prompt's last position, then after each of its tokens
    tokens: list[int]  # the unquantized model's greedy tokens


def prompt_text(window: torch.Tensor, positions: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The text before and after the encoder's ``positions`` embeddings: the first validation window's first tokens,
    as many as the cache (``context`` positions) holds beside them and the greedy steps (at least one each side:
    exporters.components' checks leave room for that)."""
    half = max(1, min(PROMPT_TEXT, window.shape[1] // 2, (context - positions - GREEDY_STEPS) // 2))
    return window[:, :half], window[:, half:2 * half]


def room_needed(positions: int) -> int:
    """The cache positions a validation prompt around ``positions`` embeddings needs (one text token each side)."""
    return positions + 2 + GREEDY_STEPS


def _eager_prompt(model: CausalLM, embedded: torch.Tensor, before: torch.Tensor, after: torch.Tensor,
                  tokens: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """The eager decoder's logits [1 + GREEDY_STEPS, V] on text, the encoder's embeddings, text and then ``tokens``
    (None: its own greedy choices), and the tokens it was given or chose. Resets the caches before and after."""
    model.reset_cache()
    embeddings = torch.cat([model.text_embeddings(before), embedded.to(model.activation_dtype()),
                            model.text_embeddings(after)], dim=1)
    logits = [model(embeddings, torch.tensor([0])).float().reshape(1, -1)]
    chosen, position = [], embeddings.shape[1]
    for step in range(GREEDY_STEPS):
        token = int(logits[-1].argmax()) if tokens is None else tokens[step]
        chosen.append(token)
        logits.append(model(torch.tensor([[token]]), torch.tensor([position])).float().reshape(1, -1))
        position += 1
    model.reset_cache()
    return torch.cat(logits), chosen


def unquantized_path(model: CausalLM, encoder: Callable[[torch.Tensor], torch.Tensor], given: torch.Tensor,
                     window: torch.Tensor) -> EncoderBaseline:
    """The baseline stage's prompt around ``given`` (the encoder's test input), through the models as loaded."""
    with torch.no_grad():
        features = encoder(given).float()
        before, after = prompt_text(window, features.shape[1], model.args.max_context_len)
        logits, tokens = _eager_prompt(model, features, before, after)
    return EncoderBaseline(features, logits, tokens)


def check_encoder_path(program: RunsMethods, method: str, given: torch.Tensor, model: CausalLM,
                       encoder: Callable[[torch.Tensor], torch.Tensor], window: torch.Tensor, max_kl: float,
                       baseline: EncoderBaseline | None = None) -> dict[str, Any]:
    """The fields of an ``EncoderCheck`` (manifest) of the prompt around ``given`` through ``method`` and the first
    validation ``window``'s text. The program's caches are overwritten from position 0; the eager model's are reset
    first and after."""
    with torch.no_grad():
        ours_embedded = program.run(method, given)[0]
        eager_embedded = encoder(given)
        before, after = prompt_text(window, eager_embedded.shape[1], model.args.max_context_len)
        error = float((ours_embedded.float() - eager_embedded.float()).abs().max())
        cosine = least_cosine(ours_embedded, eager_embedded)
        start = before.shape[1] + ours_embedded.shape[1]
        ours = torch.cat(_program_prompt(program, ours_embedded, before, after)).float()
        tokens = [int(row.argmax()) for row in ours[:-1]]
        eager, _ = _eager_prompt(model, eager_embedded, before, after, tokens)
        eager_choices = [int(row.argmax()) for row in eager[:-1]]
        quality = None
        if baseline is not None:  # the program on the unquantized model's tokens, against it
            theirs = torch.cat(_program_prompt(program, ours_embedded, before, after, baseline.tokens))
            agreement = Agreement.of(baseline.logits, theirs.float())
            quality = PromptQuality(encoder_cosine=least_cosine(eager_embedded, baseline.features),
                                    kl_mean=float(agreement.kl.mean()), kl_max=float(agreement.kl.max()),
                                    top1=float(agreement.top1.float().mean()))
    kl = float(Agreement.of(eager, ours).kl.max())
    failures = [*([f"embeddings: least cosine {cosine:.4f} < {MIN_COSINE}"] if cosine < MIN_COSINE else []),
                *([f"prompt: KL {kl:.3g} > {max_kl:.3g}"] if kl > max_kl else [])]
    return dict(passed=not failures, failures=failures, max_abs_error=error, cosine=cosine,
                prompt_tokens=start + after.shape[1], kl_max=kl, greedy_tokens=tokens, eager_choices=eager_choices,
                tolerance={"max_kl": max_kl, "min_cosine": MIN_COSINE}, unquantized=quality)


def least_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The least cosine similarity of one position's embedding between ``a`` and ``b`` ([1, N, hidden]); equal
    embeddings count as 1, zero ones included (a projector of zeros: torch's cosine of two zero vectors is 0)."""
    a, b = a[0].float(), b[0].float()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return float(torch.where((a == b).all(dim=-1), torch.ones_like(cosine), cosine).min())


def _program_step(program: RunsMethods, tokens: torch.Tensor, start: int) -> torch.Tensor:
    return program.run(DECODER, program.run(EMBED, tokens)[0], torch.tensor([start]))[0].reshape(1, -1)


def _program_prompt(program: RunsMethods, embedded: torch.Tensor, before: torch.Tensor, after: torch.Tensor,
                    tokens: list[int] | None = None) -> list[torch.Tensor]:
    """The program as the MultimodalRunner drives it (text, the encoder's embeddings, text, each in one call; each
    method's output given to the next as it is), then GREEDY_STEPS tokens (``tokens``, else its own greedy choices):
    the logits [1, V] after the prompt and after each token, GREEDY_STEPS + 1 of them."""
    _program_step(program, before, 0)
    program.run(DECODER, embedded, torch.tensor([before.shape[1]]))
    position = before.shape[1] + embedded.shape[1]
    logits = [_program_step(program, after, position)]
    position += after.shape[1]
    for step in range(GREEDY_STEPS):
        token = int(logits[-1].argmax()) if tokens is None else tokens[step]
        logits.append(_program_step(program, torch.tensor([[token]]), position))
        position += 1
    return logits
