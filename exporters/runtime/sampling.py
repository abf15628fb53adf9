"""How the next token is chosen from logits: greedy, or drawn at a temperature from the top-p nucleus."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0



def distribution(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The probabilities a token is drawn from (temperature > 0): softmax at the temperature, cut to top-p."""
    probs = torch.softmax(logits.float().reshape(-1) / cfg.temperature, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < cfg.top_p  # smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return probs / probs.sum()


def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator) -> int:
    logits = logits.float().reshape(-1, logits.shape[-1])[-1]
    if cfg.temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(distribution(logits, cfg), 1, generator=generator))
