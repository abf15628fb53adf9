"""Learned 4-bit scales: SignRound's signed gradient descent (Cheng et al., 2023, "Optimize Weight Rounding via
Signed Gradient Descent"; the algorithm of Intel's ``auto-round``) on each decoder layer's output, in exactly the
integer format XNNPACK runs.

GPTQ chooses each linear's codes to keep that one linear's output close on the calibration inputs. Here a whole
decoder layer learns at once: a factor on every group's scale (and, with ``rounding``, an offset in [-0.5, 0.5] on
every weight before it is rounded, so each may round up or down), by signed gradient steps on the layer's output
error: the quantized layer, fed what the quantized layers before it give, should give what the unquantized layer
gives on the unquantized inputs. The error is attention and MLP together against the unquantized model, so the
earlier layers' errors are compensated too.

What learns was chosen by measurement on SmolLM2-135M (docs/quality.md#learned-4-bit): the projections that feed
the attention scores (q, k, v) take GPTQ's codes, because learned through the softmax on a few thousand calibration
tokens they fit that text and lose on other text; the per-weight rounding offsets (``rounding``, off by default),
a parameter per weight, fit it too. On SmolLM2 the result is still short of GPTQ alone (+12.8% against +9.9% on
unseen text): this is the learned path's first form, not yet the better one.

The codes and scales come out as GPTQ's do: symmetric codes in ``[qmin, qmax]``, scales rounded to bf16 (XNNPACK's
blockwise kernels store them so), set through the scheme's torchao weight (the same program format and size).
``lm_head`` (its error is the logits', not a layer's) keeps GPTQ.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from exporters.quant.calibrated import Target, calibrate_layer, finish_with_head
from exporters.quant.calibration import CalibrationText, LayerByLayer
from exporters.quant.gptq import IntGrid, static_scales
from exporters.quant.learning import bf16_ste, detach_buffers, differentiable_attention, round_ste
from models.decoder import CausalLM
from models.mapped_pages import release_file_pages

log = logging.getLogger("exporters")

# The scale factor's range: a group's scale may shrink (clipping its largest weights for a finer step elsewhere)
# or grow a little from where the activation-weighted search put it.
SCALE_FACTOR = (0.5, 1.25)
# Steps a layer learns for when quant.learning.steps is null.
DEFAULT_STEPS = 50
# Linears whose outputs make the attention scores: GPTQ's codes, not learned ones.
SCORE_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj")


@dataclass(frozen=True)
class Learning:
    """How long each decoder layer learns (``steps``, one calibration window each), the signed step's size (``lr``;
    the paper's 1/steps when None, decayed linearly to zero), and whether each weight's rounding is learned too."""

    steps: int
    lr: float | None = None
    rounding: bool = False

    def rate(self, step: int) -> float:
        base = self.lr if self.lr is not None else 1.0 / self.steps
        return base * (1.0 - step / self.steps)


class LearnedRounding(nn.Module):
    """A linear's weight as its quantized value, ``clamp(round(W / s + v)) * s`` with ``s = bf16(s0 * factor)`` per
    group, registered as a parametrization of ``weight``: ``s0`` the activation-weighted scale search's, ``factor``
    learned (and ``v``, with ``rounding``)."""

    def __init__(self, weight: torch.Tensor, grid: IntGrid, importance: torch.Tensor, rounding: bool) -> None:
        super().__init__()
        rows, cols = weight.shape
        self.grid, self.group = grid, grid.group_size or cols
        self.shape = (rows, cols // self.group, self.group)
        self.register_buffer("s0", static_scales(weight.float(), importance, grid), persistent=False)
        self.factor = nn.Parameter(torch.ones(self.s0.shape))
        self.offset = nn.Parameter(torch.zeros(self.shape)) if rounding else None

    def scales(self) -> torch.Tensor:
        return bf16_ste(self.s0 * self.factor) if self.grid.bf16_scales else self.s0 * self.factor

    def codes(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.scales()[..., None]
        x = weight.float().reshape(self.shape) / scale
        q = torch.clamp(round_ste(x if self.offset is None else x + self.offset), self.grid.qmin, self.grid.qmax)
        return q, scale

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        q, scale = self.codes(weight)
        return (q * scale).reshape(weight.shape).to(weight.dtype)

    @torch.no_grad()
    def step(self, rate: float) -> None:
        """One signed-gradient step, each parameter kept in its range."""
        for p, (low, high) in ((self.factor, SCALE_FACTOR), (self.offset, (-0.5, 0.5))):
            if p is not None and p.grad is not None:
                p -= rate * p.grad.sign()
                p.clamp_(low, high)
                p.grad = None

    @torch.no_grad()
    def result(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes int8 [rows, cols], scales fp32 [rows, groups])``: what the kernels will compute with."""
        q, scale = self.codes(weight)
        return q.reshape(weight.shape).to(torch.int8), scale[..., 0].float()


def _input_energy(run: LayerByLayer, i: int, states: list[torch.Tensor],
                  targets: dict[str, Target]) -> dict[str, torch.Tensor]:
    """Each target's inputs' energy per column (``sum x^2`` over the calibration tokens), which weighs the initial
    scale search as GPTQ's does."""
    energy: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            energy[name] = energy.get(name, 0) + (x * x).sum(dim=0)
        return record

    handles = [t.module.register_forward_pre_hook(hook(n)) for n, t in targets.items()]
    try:
        run.layer(i, states)
    finally:
        for h in handles:
            h.remove()
    return energy


def _learn_layer(run: LayerByLayer, i: int, targets: dict[str, Target], inputs: list[torch.Tensor],
                 goals: list[torch.Tensor], learning: Learning) -> float:
    """Learn the scales (and with ``learning.rounding`` the rounding) of ``targets``, linears of layer ``i``, on
    ``inputs`` -> ``goals`` (windows), then store their integer weights; the last steps' mean output error relative
    to the first's."""
    if not targets:
        return 1.0
    energy = _input_energy(run, i, inputs, targets)
    learners: dict[str, LearnedRounding] = {}
    for name, t in targets.items():
        grid = t.scheme.grid(t.group_size)
        cols = t.module.weight.shape[1]
        learners[name] = LearnedRounding(t.module.weight.detach(), grid,
                                         energy[name].reshape(cols // (grid.group_size or cols), -1), learning.rounding)
        parametrize.register_parametrization(t.module, "weight", learners[name], unsafe=True)
    layer = run.model.model.layers[i]
    losses: list[float] = []
    try:
        with torch.enable_grad(), differentiable_attention(layer, inputs[0].dtype):
            for step in range(learning.steps):
                w = step % len(inputs)
                detach_buffers(layer)
                out = run.window(i, w, inputs[w])
                loss = torch.nn.functional.mse_loss(out.float(), goals[w].float())
                loss.backward()
                rate = learning.rate(step)
                for learner in learners.values():
                    learner.step(rate)
                losses.append(loss.item())
    finally:
        detach_buffers(layer)
        for name, t in targets.items():
            original = t.module.parametrizations.weight.original
            codes, scales = learners[name].result(original)
            parametrize.remove_parametrizations(t.module, "weight", leave_parametrized=False)
            t.module.weight = nn.Parameter(t.scheme.weight(codes, scales, t.group_size, original.dtype),
                                           requires_grad=False)
            release_file_pages([original])
    tail = max(1, len(losses) // 10)
    return (sum(losses[-tail:]) / tail) / max(sum(losses[:tail]) / tail, 1e-30)


@torch.no_grad()
def quantize_learned(model: CausalLM, targets: dict[str, Target], text: CalibrationText, learning: Learning,
                     step: Callable[[], None]) -> None:
    """Quantize ``targets`` one decoder layer at a time: its score projections with GPTQ, the others with scales
    learned on ``text`` against the unquantized layer's output; then ``lm_head`` with GPTQ on the final norm's
    outputs; ``step`` once per quantized linear."""
    run = LayerByLayer(model, text.windows)
    exact = run.embedded  # the unquantized model's hidden states
    states = [h.clone() for h in exact]  # the quantized model's
    solved: set[str] = set()
    started = time.perf_counter()
    for i in range(len(model.model.layers)):
        here = {n: t for n, t in targets.items() if n.startswith(f"model.layers.{i}.")}
        goals = run.layer(i, exact)
        if here:
            scores = {n: t for n, t in here.items() if n.rsplit(".", 1)[-1] in SCORE_PROJECTIONS}
            if scores:  # GPTQ, on the inputs the quantized layers before give
                calibrate_layer(run, i, states, scores, step)
            kept = _learn_layer(run, i, {n: t for n, t in here.items() if n not in scores}, states, goals, learning)
            solved.update(here)
            for _ in range(len(here) - len(scores)):
                step()
            log.debug("signround: layer %d learned in %.1f s (output error x%.2f)", i,
                      time.perf_counter() - started, kept)
        states = run.layer(i, states)
        exact = goals
    finish_with_head(model, targets, states, solved, step)
