"""Distilled group scales (``quant.algorithm=distill``): GPTQ's codes, then every group scale of the model learned at
once against the unquantized model's predictions on the calibration text (the idea of MLX's DWQ, for XNNPACK's
symmetric codes).

GPTQ keeps each linear's output close to the unquantized linear's on the calibration inputs, one linear at a time.
What an export is judged by is the model's next-token distribution, and learning one layer at a time against its
own output measured worse than GPTQ (``signround``, docs/quality.md#learned-4-bit). Here the target is that
distribution itself: the KL divergence from the unquantized model's predictions (computed once, before any weight is
quantized) to the quantized model's, through the whole model and the int8 rounding of its activations as the
kernels do it, by Adam on one factor per group scale (in log space, so a step is a relative change).

The codes stay GPTQ's, the scales come out rounded to bf16 as XNNPACK stores them: the same torchao weight, program
format and size as ``gptq``. A scale is 1/32 of its group's parameters, so little that a few thousand calibration
tokens constrain it (per-weight rounding offsets fit that text and lose on other text: ``signround``'s measurement).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from exporters.config import Algorithm, KvDType, QuantConfig
from exporters.errors import UserError
from exporters.quant.calibrated import Target
from exporters.quant.calibration import WINDOW_TOKENS, CalibrationText, LayerByLayer
from exporters.quant.learning import bf16_ste, detach_buffers, every_attention_differentiable
from exporters.quant.mixed import mean_kl
from exporters.runtime.quality import full_sequence
from models.decoder import CausalLM, Mixer

log = logging.getLogger("exporters")

# Adam steps over the calibration windows, one window a step, when quant.learning.steps is null: five passes over
# the shipped text's 12 windows of 256 tokens (measured on SmolLM2-135M, docs/quality.md#learned-4-bit).
DEFAULT_STEPS = 60
# Adam's step on the log of each scale factor when quant.learning.lr is null, decayed linearly to zero.
DEFAULT_LR = 1e-3


def check_distillable(shapes: CausalLM, quant: QuantConfig) -> None:
    """Refused before any weight is read: a model whose layers pass no gradient to the layers before them. Qwen3.5's
    Gated DeltaNet runs ExecuTorch's ``llama::gated_delta_rule`` kernel, which has no autograd formula: its
    projections would learn nothing and every layer before it would learn from a gradient with a hole in it."""
    if quant.algorithm == Algorithm.distill and Mixer.gated_delta in shapes.args.layer_mixer:
        raise UserError("quant.algorithm=distill learns through the whole model, and this model's Gated DeltaNet "
                        "layers run ExecuTorch's gated_delta_rule kernel, which passes no gradient. Use "
                        "quant=8da4w_calibrated (GPTQ, layer by layer: it runs these layers) instead.")


@dataclass(frozen=True)
class Distillation:
    """How long the scales learn (``steps`` Adam steps of one calibration window each) and how fast (``lr``)."""

    steps: int
    lr: float

    def rate(self, step: int) -> float:
        return self.lr * (1.0 - step / self.steps)


@torch.no_grad()
def unquantized_predictions(model: CausalLM, text: CalibrationText) -> list[torch.Tensor]:
    """The unquantized model's log-probabilities [L, V] on each calibration window (bf16: half the memory, and
    the teacher's rounding is far below what the 4-bit student can match), with an fp32 KV cache."""
    with model.kv_dtype_as(KvDType.fp32):
        run = full_sequence(model)
        out = [F.log_softmax(run(window), dim=-1).to(torch.bfloat16) for window in text.windows]
    model.reset_cache()
    return out


# What one learning step keeps of a window, besides the teacher's predictions: [tokens, vocab] fp32 tensors alive at
# once (logits, log-probabilities, the teacher's in fp32, their gradients) and, per value a linear reads or writes,
# the activations autograd saves for the backward pass. Checked against SmolLM2-135M's export (its peak now in
# quantize): 3395 MB estimated, 3263 MB measured.
STEP_LOGITS_COPIES = 5
SAVED_PER_LINEAR_VALUE = 1.5


def learning_bytes(shapes: CausalLM, quant: QuantConfig, saved_values: int) -> int:
    """What learning against the unquantized model's predictions holds, whatever it learns (from ``shapes`` on the
    meta device): the teacher's predictions (bf16, at most quant.calibration.max_tokens), one window's logits and
    their gradients, its attention scores, and ``saved_values`` values per token the linears keep for the backward
    pass (fp32)."""
    a = shapes.args
    window = min(a.max_context_len, WINDOW_TOKENS)
    scores = sum(layer.self_attn.args.num_attention_heads for layer in shapes.attention_layers()) * window * window
    return (quant.calibration.max_tokens * a.vocab_size * 2 + STEP_LOGITS_COPIES * window * a.vocab_size * 4
            + int(SAVED_PER_LINEAR_VALUE * window * saved_values * 4) + 2 * scores * 4)


def distill_bytes(shapes: CausalLM, quant: QuantConfig) -> int:
    """What distillation holds beside the calibrated model (the memory estimate's term): :func:`learning_bytes` with
    each linear's input and output kept, and per group scale its factor, gradient and Adam's two moments."""
    linears = [m for m in shapes.modules() if isinstance(m, nn.Linear)]
    values = sum(m.in_features + m.out_features for m in linears)
    scales = sum(m.weight.numel() for m in linears) // max(quant.group_size, 1)
    return learning_bytes(shapes, quant, values) + scales * 4 * 4


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` through the kernels' dynamic activation rounding (int8, asymmetric, one scale per token), with torchao's
    public primitives in the order its ``IntxUnpackedToInt8Tensor`` linear calls them in eager (XNNPACK's 8da kernels
    in the program): the values the quantized eager model computes with."""
    from torchao.quantization import MappingType, choose_qparams_affine, dequantize_affine, quantize_affine

    block = (1,) * (x.dim() - 1) + (x.shape[-1],)
    scale, zero = choose_qparams_affine(x, MappingType.ASYMMETRIC, block, torch.int8, -128, 127,
                                        zero_point_dtype=torch.int8)
    q = quantize_affine(x, block, scale, zero, torch.int8, -128, 127)
    return dequantize_affine(q, block, scale, zero, torch.int8, -128, 127, output_dtype=x.dtype)


class _CodesTimesScales(torch.autograd.Function):
    """``linear(x, codes * scales)`` whose backward recomputes the weight from the int8 codes instead of keeping
    a float copy of every weight for it (four times the model's 4-bit codes in fp32, per step); the activation's
    rounding is passed straight through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int,
                rounded_activations: bool) -> torch.Tensor:
        xq = int8_per_token(x) if rounded_activations else x
        ctx.save_for_backward(xq, codes, scales)
        ctx.group = group
        return F.linear(xq, _weight(codes, scales, group).to(xq.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xq, codes, scales = ctx.saved_tensors
        rows, cols = codes.shape
        grad_x = grad @ _weight(codes, scales, ctx.group).to(grad.dtype)
        grad_w = grad.reshape(-1, rows).float().T @ xq.reshape(-1, cols).float()
        grad_scales = (grad_w.view(rows, -1, ctx.group) * codes.view(rows, -1, ctx.group)).sum(dim=-1)
        return grad_x, None, grad_scales, None, None


def _weight(codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    rows, cols = codes.shape
    return (codes.view(rows, -1, group).float() * scales[..., None]).view(rows, cols)


class DistilledLinear(nn.Module):
    """A quantized linear (its weight torchao's ``IntxUnpackedToInt8Tensor``) whose group scales learn: ``s0 *
    exp(log_factor)``, rounded to bf16 forward where XNNPACK stores them so (blockwise; per-row scales stay fp32),
    codes fixed."""

    def __init__(self, linear: nn.Linear, target: Target) -> None:
        super().__init__()
        weight = linear.weight
        self.linear, self.target = linear, target
        self.codes = weight.qdata  # int8 [rows, cols]
        self.register_buffer("s0", weight.scale.float(), persistent=False)  # [rows, groups]
        self.log_factor = nn.Parameter(torch.zeros_like(self.s0))
        self.group = self.codes.shape[1] // self.s0.shape[1]
        self.bf16_scales = target.scheme.grid(target.group_size).bf16_scales

    @property
    def in_features(self) -> int:  # what a mixer may read of its projections (models.short_conv)
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def scales(self) -> torch.Tensor:
        scales = self.s0 * self.log_factor.exp()
        return bf16_ste(scales) if self.bf16_scales else scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _CodesTimesScales.apply(x, self.codes, self.scales(), self.group, self.target.scheme.dynamic_activations)
        return y if self.linear.bias is None else y + self.linear.bias

    @torch.no_grad()
    def learned(self) -> nn.Linear:
        """The linear again, its weight the same codes with the learned scales."""
        t, dtype = self.target, self.linear.weight.dtype
        self.linear.weight = nn.Parameter(t.scheme.weight(self.codes, self.scales().float(), t.group_size, dtype),
                                          requires_grad=False)
        return self.linear


def _swap(model: CausalLM, targets: dict[str, Target]) -> dict[str, DistilledLinear]:
    learners = {}
    for name, target in targets.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        learners[name] = DistilledLinear(getattr(owner, child), target)
        setattr(owner, child, learners[name])
    return learners


def _restore(model: CausalLM, learners: dict[str, DistilledLinear]) -> None:
    for name, learner in learners.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, learner.learned())


def distill_scales(model: CausalLM, targets: dict[str, Target], text: CalibrationText,
                   teacher: list[torch.Tensor], distillation: Distillation,
                   progress: Callable[[int, float], None]) -> list[float]:
    """Learn the group scales of ``targets`` (quantized linears, codes fixed) so the model's predictions on ``text``
    match ``teacher``'s (:func:`unquantized_predictions`); ``progress(step, kl)`` after each step. The KL of each
    step, in order."""
    with torch.no_grad():
        run = LayerByLayer(model, text.windows)  # every window's embeddings, positions and masks, computed once
    frozen = [p for p in model.parameters() if p.requires_grad]  # only the scales learn: no other gradient computed
    for p in frozen:
        p.requires_grad_(False)
    learners = _swap(model, targets)
    optimizer = torch.optim.Adam([learner.log_factor for learner in learners.values()], lr=distillation.lr)
    layers = model.model.layers
    losses: list[float] = []
    try:
        with torch.enable_grad(), every_attention_differentiable(layers, run.embedded[0].dtype):
            for step in range(distillation.steps):
                w = step % len(text.windows)
                detach_buffers(model)
                h = run.embedded[w]
                for i in range(len(layers)):
                    h = run.window(i, w, h)
                loss = mean_kl(teacher[w].float(), model.final_logits(h)[0])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                for group in optimizer.param_groups:
                    group["lr"] = distillation.rate(step)
                optimizer.step()
                losses.append(loss.item())
                progress(step, losses[-1])
    finally:
        detach_buffers(model)
        _restore(model, learners)
        model.reset_cache()
        for p in frozen:
            p.requires_grad_(True)
    return losses


def first_and_last_pass(kl: list[float], windows: int) -> tuple[float, float] | None:
    """The mean KL of :func:`distill_scales`'s first and last pass over the ``windows`` calibration windows (the
    manifest's record of what learning did), or None without steps."""
    if not kl:
        return None
    one_pass = min(windows, len(kl))
    return round(sum(kl[:one_pass]) / one_pass, 5), round(sum(kl[-one_pass:]) / one_pass, 5)


def timed_progress(steps: int, label: str) -> Callable[[int, float], None]:
    """Progress lines for :func:`distill_scales`: the first step's time and what the whole will take, then a line
    each quarter with the KL of the last windows."""
    started = time.perf_counter()
    recent: list[float] = []
    quarter = max(1, steps // 4)

    def report(step: int, kl: float) -> None:
        recent.append(kl)
        elapsed = time.perf_counter() - started
        if step == 0:
            log.info("  %s: distilling the scales, %d steps of %.1f s (about %.0f s)", label, steps, elapsed,
                     elapsed * steps)
        elif (step + 1) % quarter == 0 or step + 1 == steps:
            log.info("  %s: distilled %d/%d steps, KL to the unquantized model %.4f (last %d windows), %.0f s",
                     label, step + 1, steps, sum(recent) / len(recent), len(recent), elapsed)
            recent.clear()
    return report
