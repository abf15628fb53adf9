"""Mixed precision under a size budget: the linears whose 4-bit rounding costs the model most get 8 bits.

``quant.size_budget=1.05`` lets the program's weights grow to 1.05x the uniform scheme's. Which layers get
the extra bytes is measured, not guessed: each candidate linear is rounded alone (every other weight left as
it is), at its low and at its high precision, and the rest of the model is run on calibration text from that
layer on; the mean KL of the output distribution against the unrounded model's is that layer's cost at each
precision. Layers are then upgraded greedily in order of KL saved per extra byte until the budget is spent
(the KL of a few small perturbations adds up nearly independently, so a knapsack over single-layer
measurements is the standard approximation: HAWQ-v2, Dong et al. 2020).

The rounding measured is round-to-nearest with the format's own grid (bf16 group scales for 4-bit, per-row
fp32 for 8-bit), with the best of a few clipped scales: a layer's sensitivity is a property of the layer and
the format, and the algorithm that later picks the codes (HQQ or GPTQ) shrinks the error of every layer alike.
Activations are left in floating point: 8da4w and 8da8w quantize them the same way, so they cancel in the
difference that decides.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from exporters.quant.calibration import CalibrationText, LayerByLayer
from exporters.quant.gptq import static_scales
from exporters.quant.schemes import IntScheme
from models.decoder import CausalLM

log = logging.getLogger("exporters")

# Calibration tokens the sensitivity of each layer is measured on: the measurement runs the rest of the model
# twice per candidate layer, so it reads only the start of the text. On SmolLM2-135M (29 linears of layers 0, 7,
# 15, 29 and lm_head) 128 tokens rank the layers as 512 do (Spearman 0.994 at 4 bits, 0.99 at 8) in a quarter
# of the time (512 tokens: 67 s for those 29, about 8 min for all 211).
SENSITIVITY_TOKENS = 128


@dataclass(frozen=True)
class Precision:
    """One way to store a linear: its integer scheme (a key of LINEAR_SCHEMES) and group size (0: per row)."""

    scheme: str
    integer: IntScheme
    group_size: int

    def bytes(self, rows: int, cols: int) -> int:
        """Bytes the program stores for a [rows, cols] weight: packed codes plus scales (bf16 per group, as
        XNNPACK's blockwise kernels keep them; fp32 per row)."""
        scales = rows * (cols // self.group_size) * 2 if self.group_size else rows * 4
        return rows * cols * self.integer.bits // 8 + scales

    def rounded(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` rounded to this format (round to nearest, best clipped scale), back in floating point."""
        w = weight.detach().float()
        grid = self.integer.grid(self.group_size)
        scales = static_scales(w, torch.ones(w.shape[1]), grid)
        per_column = scales.repeat_interleave(self.group_size or w.shape[1], dim=1)
        return (grid.codes(w, per_column) * per_column).to(weight.dtype)


@dataclass(frozen=True)
class Candidate:
    """A linear that may be stored at ``low`` (the uniform scheme) or ``high`` precision."""

    module: nn.Linear
    low: Precision
    high: Precision

    @property
    def extra_bytes(self) -> int:
        rows, cols = self.module.weight.shape
        return self.high.bytes(rows, cols) - self.low.bytes(rows, cols)


@dataclass(frozen=True)
class Sensitivity:
    """Mean KL (nats per token) of the model's outputs with this one layer rounded at each precision."""

    kl_low: float
    kl_high: float


def mean_kl(reference_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(reference || model), from the reference's log-probabilities (differentiable in
    ``logits``: distillation learns from it)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return (reference_logp.exp() * (reference_logp - logp)).sum(-1).mean()


@torch.no_grad()
def measure_sensitivity(model: CausalLM, candidates: dict[str, Candidate], text: CalibrationText,
                        step: Callable[[], None]) -> dict[str, Sensitivity]:
    """Each candidate's KL at its low and high precision, on the first :data:`SENSITIVITY_TOKENS` of ``text``.

    The hidden states entering every layer are kept from one unrounded pass, so a layer's measurement runs the
    model from that layer on only.
    """
    run = LayerByLayer(model, text.first(SENSITIVITY_TOKENS))
    layers = len(model.model.layers)

    def run_from(first: int, states: list[torch.Tensor]) -> torch.Tensor:
        for i in range(first, layers):
            states = run.layer(i, states)
        return torch.cat([model.final_logits(h) for h in states], dim=1)

    entering = [run.embedded]
    for i in range(layers):
        entering.append(run.layer(i, entering[-1]))
    reference = torch.log_softmax(run_from(layers, entering[-1]).float(), dim=-1)

    result: dict[str, Sensitivity] = {}
    for name, candidate in candidates.items():
        first = int(name.split(".")[2]) if name.startswith("model.layers.") else layers
        original = candidate.module.weight.data
        kls = []
        for precision in (candidate.low, candidate.high):
            candidate.module.weight.data = precision.rounded(original)
            try:
                kls.append(float(mean_kl(reference, run_from(first, entering[first]))))
            finally:
                candidate.module.weight.data = original
        result[name] = Sensitivity(*kls)
        step()
    model.reset_cache()
    return result


def choose_upgrades(candidates: dict[str, Candidate], sensitivity: dict[str, Sensitivity],
                    allowance: int) -> list[str]:
    """The candidates to store at high precision: most KL saved per extra byte first, while the extra bytes fit
    in ``allowance``; a layer that gains nothing stays low."""
    def value(name: str) -> float:
        s = sensitivity[name]
        return (s.kl_low - s.kl_high) / max(candidates[name].extra_bytes, 1)

    chosen, spent = [], 0
    for name in sorted(candidates, key=value, reverse=True):
        cost = candidates[name].extra_bytes
        if value(name) <= 0 or spent + cost > allowance:
            continue  # a smaller layer further down may still fit
        chosen.append(name)
        spent += cost
    return chosen


def weight_bytes(model: nn.Module, stored_as: dict[nn.Module, int], dtype_bytes: int) -> int:
    """Bytes of every distinct parameter, the modules in ``stored_as`` counted at the bytes given there."""
    counted, total = set(), 0
    for module in model.modules():
        if module in stored_as:
            total += stored_as[module]
            counted.update(id(p) for p in module.parameters(recurse=False))
    for p in model.parameters():
        if id(p) not in counted:
            counted.add(id(p))
            total += p.numel() * dtype_bytes
    return total
