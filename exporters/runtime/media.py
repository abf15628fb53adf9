"""A prompt with images or audio, fed as ExecuTorch's MultimodalRunner feeds it: each text segment through
``token_embedding`` then ``text_decoder``, each image or recording through its encoder (``vision_encoder``,
``audio_encoder``) then ``text_decoder``, at consecutive positions (an image or a recording takes as many positions
as its encoder gives embeddings). The prompts are made by ``exporters.runtime.images`` and ``exporters.runtime.heard``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exporters.runtime.driver import Driver, MethodRoles, RunsMethods


@dataclass(frozen=True)
class MediaPrompt:
    ids: list[int]  # the prompt's tokens, each image's or recording's positions as its token
    parts: list[torch.Tensor]  # in order: token ids [1, T] (int64), or an encoder's input (floating point)
    encoders: tuple[str, ...]  # the method each floating-point part goes through, in the parts' order

    @classmethod
    def text(cls, ids: list[int]) -> MediaPrompt:
        return cls(ids, [torch.tensor([ids])] if ids else [], ())

    @classmethod
    def of(cls, ids: list[int], parts: list[torch.Tensor], encoder: str) -> MediaPrompt:
        """Parts whose floating-point ones all go through ``encoder``."""
        return cls(ids, parts, (encoder,) * sum(part.is_floating_point() for part in parts))


def joined(*prompts: MediaPrompt) -> MediaPrompt:
    """``prompts`` one after the other as one prompt; text meeting text is one part (one call, as a runner makes it)."""
    ids: list[int] = []
    parts: list[torch.Tensor] = []
    encoders: list[str] = []
    for prompt in prompts:
        ids += prompt.ids
        encoders += prompt.encoders
        for part in prompt.parts:
            if parts and not part.is_floating_point() and not parts[-1].is_floating_point():
                parts[-1] = torch.cat([parts[-1], part], dim=1)
            else:
                parts.append(part)
    return MediaPrompt(ids, parts, tuple(encoders))


def prefill_parts(program: RunsMethods, roles: MethodRoles, prompt: MediaPrompt) -> torch.Tensor:
    """The prompt's last logits [1, V] after each part at consecutive positions: images or audio through their
    encoder, text through ``roles`` (token_embedding and text_decoder, in calls of at most
    ``roles.prompt_max_tokens``)."""
    driver, position, logits = Driver(program, roles), 0, None
    encoders = iter(prompt.encoders)
    for part in prompt.parts:
        if part.is_floating_point():
            embeddings = program.run(next(encoders), part)[0]
            logits = program.run(roles.prompt, embeddings, torch.tensor([position]))[0]
            position += embeddings.shape[1]
        else:
            logits = driver.prefill(part, position)
            position += part.shape[1]
    assert logits is not None, "a prompt has at least one part"
    return logits.reshape(-1, logits.shape[-1])[-1:]
