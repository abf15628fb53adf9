"""Learned rotations (``quant.rotation=learned``; SpinQuant, Liu et al. 2024): R1 and R2 learned on the Stiefel manifold.

``quant.rotation=hadamard`` fuses a randomized Hadamard R1 (the residual stream) and R2 (each head's values): any
rotation leaves the fp32 model's outputs unchanged, and that one spreads outliers evenly. Which rotation rounds best
depends on the weights; here R1 and R2 start at those Hadamard rotations and are turned by Cayley SGD (Li et al.
2020: each step stays exactly orthogonal) so that the model, its linears rounded to the 4-bit grid (round to nearest,
straight-through) and its activations to int8 per token as the kernels do, predicts what the unquantized model
predicts on the calibration text (the KL divergence, as ``quant.algorithm=distill`` learns by). The learned R1 and R2
are then fused exactly as the Hadamard ones are (``exporters.quant.rotation.rotate``), and ``quant.algorithm`` (GPTQ in
``quant=8da4w_rotated``) chooses the codes of the rotated model.

No weight is changed while learning: each linear computes its rotated, rounded weight from its own weight and the
norm gain before it when it runs (a step holds the rounded copies autograd keeps: the linears once more in fp32).
Pre-norm decoders only (Llama, Qwen, SmolLM, Mistral, Phi-3): the others are refused before any weight is read
(``exporters.quant.rotation.check_rotation``). Measured in docs/quality.md: better perplexity than the Hadamard start,
the same KL against the unquantized model, several times its time and memory (experimental).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from exporters.config import QuantConfig
from exporters.quant.calibration import CalibrationText, LayerByLayer
from exporters.quant.distill import int8_per_token, learning_bytes, unquantized_predictions
from exporters.quant.gptq import IntGrid
from exporters.quant.learning import every_attention_differentiable
from exporters.quant.mixed import mean_kl
from exporters.quant.rotation import Learner
from models.decoder import CausalLM, RMSNorm

log = logging.getLogger("exporters")

# Cayley SGD steps (one calibration window each) when quant.rotation_steps is null, and the bound on each step
# (SpinQuant's learning rate; each step is also bounded by 1 / |A|, Li et al.).
DEFAULT_STEPS = 24
DEFAULT_LR = 1.5


@dataclass(frozen=True)
class RotationLearning:
    """``steps`` Cayley SGD steps of one calibration window each, each at most ``lr`` along the gradient."""

    steps: int
    lr: float


def cayley_step(r: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """``r`` [n, n] orthogonal moved against ``grad`` along the manifold: with the skew-symmetric ``A = G R^T - R
    G^T`` (the Riemannian gradient is ``A R``), ``(I + a/2 A)^-1 (I - a/2 A) R`` is orthogonal for any step ``a``;
    ``a = min(lr, 1 / |A|)`` keeps the first steps from overshooting (Li et al.'s bound)."""
    a = grad @ r.T - r @ grad.T
    step = min(lr, 1.0 / (float(a.norm()) + 1e-8))
    eye = torch.eye(r.shape[0], dtype=r.dtype)
    return torch.linalg.solve(eye + step / 2 * a, (eye - step / 2 * a) @ r)


def nearest_orthogonal(r: torch.Tensor) -> torch.Tensor:
    """The orthogonal matrix nearest ``r`` (its polar factor), in float64: what is fused into the weights."""
    u, _, vh = torch.linalg.svd(r.double())
    return u @ vh


class _StraightThrough(torch.autograd.Function):
    """``rounding(x)`` forward, the identity backward: the rounded values with no graph of their own (the rounding
    and its scale are constants to the gradient, as the straight-through estimator treats them)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rounding: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return rounding(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _on_grid(w: torch.Tensor, grid: IntGrid) -> torch.Tensor:
    """``w`` [rows, cols] rounded to nearest on ``grid``, the group's max |w| mapped to qmax + 0.5 and the scale
    rounded as XNNPACK stores it."""
    rows, cols = w.shape
    group = grid.group_size or cols
    g = w.view(rows, cols // group, group)
    scale = grid.round_scale(g.abs().amax(dim=-1, keepdim=True) / (grid.qmax + 0.5))
    return (grid.codes(g, scale) * scale).view(rows, cols)


def _rounded(w: torch.Tensor, grid: IntGrid) -> torch.Tensor:
    """``w`` on ``grid`` (:func:`_on_grid`), straight through."""
    return _StraightThrough.apply(w, lambda x: _on_grid(x, grid))


class Rotations(nn.Module):
    """R1 [hidden, hidden] and R2 [head_dim, head_dim], learned (fp32)."""

    def __init__(self, r1: torch.Tensor, r2: torch.Tensor) -> None:
        super().__init__()
        self.r1 = nn.Parameter(r1.float().clone())
        self.r2 = nn.Parameter(r2.float().clone())


@dataclass(frozen=True)
class Turn:
    """How one linear's weight turns: its inputs by R1 after the norm ``gain`` (a reader of the stream), its outputs
    by R1^T (a writer), its inputs per head by R2 (o_proj), the ``value_rows`` of its outputs per head by R2^T."""

    gain: torch.Tensor | None = None
    reads: bool = False
    writes: bool = False
    heads_in: bool = False
    value_rows: slice | None = None


def _turned(w: torch.Tensor, bias: torch.Tensor | None, turn: Turn, r1: torch.Tensor,
            r2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias as ``exporters.quant.rotation`` fuses them for rotations ``r1`` and ``r2``."""
    if turn.reads:  # W diag(g) R1, the gain folded into the rotation: one product over the weight
        w = w @ (r1 if turn.gain is None else turn.gain[:, None].to(r1.dtype) * r1)
    elif turn.gain is not None:
        w = w * turn.gain
    if turn.heads_in:
        k = r2.shape[0]
        w = (w.view(w.shape[0], -1, k) @ r2).view_as(w)
    if turn.writes:
        w = r1.T @ w
        bias = None if bias is None else r1.T @ bias
    if turn.value_rows is not None:
        k, rows = r2.shape[0], turn.value_rows
        part = (r2.T @ w[rows].reshape(-1, k, w.shape[1])).reshape(-1, w.shape[1])
        w = torch.cat([w[:rows.start], part]) if rows.start else part
        if bias is not None:
            b = (bias[rows].view(-1, k) @ r2).reshape(-1)
            bias = torch.cat([bias[:rows.start], b]) if rows.start else b
    return w, bias


class TurnedLinear(nn.Module):
    """A linear computing with its weight turned by the learned rotations and rounded to ``grid`` (its inputs to int8
    when ``dynamic``); the rounded weight is kept for the backward pass (recomputing it there instead measured 1.3x
    the step's time on SmolLM2-135M for a copy of the linears in fp32)."""

    def __init__(self, linear: nn.Linear, turn: Turn, rotations: Rotations, grid: IntGrid, dynamic: bool) -> None:
        super().__init__()
        self.linear, self.turn, self.grid, self.dynamic = linear, turn, grid, dynamic
        self.rotations = [rotations]  # not a child: its parameters are the learner's, not this module's

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.rotations[0]
        bias = None if self.linear.bias is None else self.linear.bias.float()
        w, bias = _turned(self.linear.weight.float(), bias, self.turn, r.r1, r.r2)
        x = _StraightThrough.apply(x, int8_per_token) if self.dynamic else x
        return F.linear(x, _rounded(w, self.grid).to(x.dtype), None if bias is None else bias.to(x.dtype))


class _TurnedBack(nn.Module):
    """The residual stream turned back by R1^T before the final norm while learning (the embedding's output is turned
    by R1 in the loop): exact in fp32, fused into the weights afterwards where they are not tied."""

    def __init__(self, rotations: Rotations) -> None:
        super().__init__()
        self.rotations = [rotations]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.rotations[0].r1.T.to(x.dtype)


def _turns(model: CausalLM) -> dict[str, tuple[Turn, RMSNorm | None]]:
    """Every decoder linear's turn and the norm whose gain it takes, by module path."""
    a = model.args
    out: dict[str, tuple[Turn, RMSNorm | None]] = {}
    values = slice((a.num_attention_heads + a.num_key_value_heads) * a.head_dim, None) if a.fused_qkv else slice(0, None)
    for i, layer in enumerate(model.model.layers):
        mlp, at = layer.mlp, f"model.layers.{i}"
        norm_a, norm_m = layer.input_layernorm, layer.post_attention_layernorm
        if a.fused_qkv:
            out[f"{at}.self_attn.qkv_proj"] = (Turn(reads=True, value_rows=values), norm_a)
        else:
            out[f"{at}.self_attn.q_proj"] = (Turn(reads=True), norm_a)
            out[f"{at}.self_attn.k_proj"] = (Turn(reads=True), norm_a)
            out[f"{at}.self_attn.v_proj"] = (Turn(reads=True, value_rows=values), norm_a)
        out[f"{at}.self_attn.o_proj"] = (Turn(writes=True, heads_in=True), None)
        for name in (["gate_up_proj"] if hasattr(mlp, "gate_up_proj") else ["gate_proj", "up_proj"]):
            out[f"{at}.mlp.{name}"] = (Turn(reads=True), norm_m)
        out[f"{at}.mlp.down_proj"] = (Turn(writes=True), None)
    return out


def _norm_gain(norm: RMSNorm) -> torch.Tensor:
    return norm.weight.detach().float() + (1.0 if norm.unit_offset else 0.0)


def learn_rotations(model: CausalLM, r1: torch.Tensor, r2: torch.Tensor, text: CalibrationText,
                    teacher: list[torch.Tensor], grid: IntGrid, dynamic: bool,
                    learning: RotationLearning) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """R1 and R2 learned from ``r1`` and ``r2`` (the Hadamard start) against ``teacher`` (the unquantized model's
    log-probabilities per calibration window); the model is as it was afterwards. The learned pair (float64,
    orthogonal) and the KL of each step."""
    with torch.no_grad():
        run = LayerByLayer(model, text.windows)
    rotations = Rotations(r1, r2)
    turns, learners, norms = _turns(model), {}, {}
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    for name, (turn, norm) in turns.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        if norm is not None:
            norms[id(norm)] = norm
            turn = dataclasses.replace(turn, gain=_norm_gain(norm))
        learners[name] = TurnedLinear(getattr(owner, child), turn, rotations, grid, dynamic)
        setattr(owner, child, learners[name])
    gains = {key: norm.weight.detach().clone() for key, norm in norms.items()}
    for norm in norms.values():  # the gains are in the linears now: each norm scales by one while learning
        norm.weight.data.fill_(0.0 if norm.unit_offset else 1.0)
    norm_rotation, model.norm_rotation = model.norm_rotation, _TurnedBack(rotations)
    layers, losses = model.model.layers, []
    started = time.perf_counter()
    try:
        with torch.enable_grad(), every_attention_differentiable(layers, run.embedded[0].dtype):
            for step in range(learning.steps):
                w = step % len(text.windows)
                h = run.embedded[w] @ rotations.r1.to(run.embedded[w].dtype)
                for i in range(len(layers)):
                    h = run.window(i, w, h)
                loss = mean_kl(teacher[w].float(), model.final_logits(h)[0])
                rotations.zero_grad(set_to_none=True)
                loss.backward()
                with torch.no_grad():
                    for r in (rotations.r1, rotations.r2):
                        assert r.grad is not None
                        r.copy_(cayley_step(r.double(), r.grad.double(), learning.lr).float())
                losses.append(loss.item())
                _progress(step, learning.steps, losses, time.perf_counter() - started, len(text.windows))
                for buffer in model.buffers():
                    buffer.detach_()
    finally:
        for name, learner in learners.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, learner.linear)
        for key, norm in norms.items():
            norm.weight.data.copy_(gains[key])
        model.norm_rotation = norm_rotation
        model.reset_cache()
        for p in frozen:
            p.requires_grad_(True)
    return nearest_orthogonal(rotations.r1.detach()), nearest_orthogonal(rotations.r2.detach()), losses


def _progress(step: int, steps: int, losses: list[float], elapsed: float, windows: int) -> None:
    if step == 0:
        log.info("  quantize: learning the rotations, %d steps of %.1f s (about %.0f s)", steps, elapsed,
                 elapsed * steps)
    elif (step + 1) % max(1, steps // 4) == 0 or step + 1 == steps:
        recent = losses[-min(windows, len(losses)):]
        log.info("  quantize: rotations learned %d/%d steps, KL to the unquantized model %.4f (last %d windows), "
                 "%.0f s", step + 1, steps, sum(recent) / len(recent), len(recent), elapsed)


def learner(model: CausalLM, text: CalibrationText, grid: IntGrid, dynamic: bool, steps: int | None) -> Learner:
    """The ``learn`` of ``exporters.quant.rotation.rotate``: the unquantized model's predictions on ``text`` taken
    first (the start rotations do not change them), then R1 and R2 learned against them for ``steps`` (null:
    DEFAULT_STEPS)."""
    learning = RotationLearning(steps or DEFAULT_STEPS, DEFAULT_LR)

    def learn(r1: torch.Tensor, r2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
        teacher = unquantized_predictions(model, text)
        q, q2, losses = learn_rotations(model, r1, r2, text, teacher, grid, dynamic, learning)
        first, last = losses[:len(text.windows)], losses[-len(text.windows):]
        return q, q2, (f"learned in {learning.steps} steps (KL to the unquantized model {sum(first) / len(first):.4f} "
                       f"in the first pass, {sum(last) / len(last):.4f} in the last)")
    return learn


# The linears' weights autograd keeps per step: the rounded weight each linear multiplied by, and the turned one a head
# rotation passes on (fp32).
SAVED_WEIGHT_COPIES = 1.5


def learned_rotation_bytes(shapes: CausalLM, quant: QuantConfig) -> int:
    """What learning the rotations holds beside the model (the memory estimate's term): ``distill.learning_bytes``
    with each linear's input kept, and the linears' rounded weights."""
    linears = [m for m in shapes.modules() if isinstance(m, nn.Linear)]
    inputs = sum(m.in_features for m in linears)
    weights = sum(m.weight.numel() for m in linears)
    return learning_bytes(shapes, quant, inputs) + int(SAVED_WEIGHT_COPIES * weights * 4)
