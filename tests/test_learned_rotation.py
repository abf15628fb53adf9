"""Learned rotations (``quant.rotation=learned``, ``exporters.quant.learned_rotation``): what learning computes with is
what is fused afterwards, each step stays a rotation, the learned rotation is exact in fp32 and rounds better than
the Hadamard start on the text it learned from, and what it cannot learn is refused before any weight is read."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from exporters.errors import UserError
from exporters.quant.calibration import CalibrationText
from exporters.quant.distill import unquantized_predictions
from exporters.quant.hadamard import random_rotation
from exporters.quant.learned_rotation import (RotationLearning, _rounded, _turned, _turns, cayley_step,
                                              learn_rotations)
from exporters.quant.rotation import _around, rotate
from exporters.quant.schemes import LINEAR_SCHEMES
from models.checkpoint import build_model, open_checkpoint
from models.decoder import CausalLM, RMSNorm

GRID = LINEAR_SCHEMES["8da4w"].grid(16)


def _model(family_checkpoint, family: str) -> CausalLM:
    model = build_model(open_checkpoint(family_checkpoint(family)), 48)
    gen = torch.Generator().manual_seed(1)
    for module in model.modules():  # gains away from one: folding them is tested, not skipped
        if isinstance(module, RMSNorm):
            module.weight.data = torch.rand(module.weight.shape, generator=gen) * 1.5 + 0.25
    return model


def _text(model: CausalLM, windows: int = 2, tokens: int = 24) -> CalibrationText:
    gen = torch.Generator().manual_seed(2)
    return CalibrationText("test", "", [torch.randint(0, model.args.vocab_size, (1, tokens), generator=gen)
                                        for _ in range(windows)])


def _starts(model: CausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    return _around(model.args.hidden_size, [], 0)[0], random_rotation(model.args.head_dim, 1)[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_learning_computes_with_the_weights_the_rotation_fuses(family_checkpoint, family: str) -> None:
    """For any R1 and R2, each linear's turned weight while learning (norm gain, R1, R2, bias) is the weight
    ``rotate`` fuses for them: Llama, Qwen 2 (biases on q/k/v), Phi-3 (fused q/k/v and gate/up)."""
    model = _model(family_checkpoint, family)
    q, q2 = _starts(model)
    turned = {}
    for name, (turn, norm) in _turns(model).items():
        linear = model.get_submodule(name)
        gain = None if norm is None else norm.weight.detach().double() + (1.0 if norm.unit_offset else 0.0)
        bias = None if linear.bias is None else linear.bias.detach().double()
        turned[name] = _turned(linear.weight.detach().double(), bias, dataclasses.replace(turn, gain=gain), q, q2)
    fused = copy.deepcopy(model)
    rotate(fused, residual_and_heads=True, online_hadamard=False, keep_tied=True, learn=lambda r1, r2: (r1, r2, "x"))
    for name, (w, b) in turned.items():
        linear = fused.get_submodule(name)
        torch.testing.assert_close(w.float(), linear.weight, rtol=0, atol=1e-6, msg=name)
        if b is not None:
            torch.testing.assert_close(b.float(), linear.bias, rtol=0, atol=1e-6, msg=name)


def test_a_cayley_step_stays_a_rotation_and_descends() -> None:
    """Each step is orthogonal to float64 precision, and a small one lowers a smooth loss of the rotation."""
    r = random_rotation(12, 0)[0]
    target = torch.linalg.qr(torch.randn(12, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64))[0]
    r = r.clone().requires_grad_(True)
    loss = ((r - target) ** 2).sum()
    loss.backward()
    moved = cayley_step(r.detach(), r.grad, 0.05)
    assert torch.allclose(moved @ moved.T, torch.eye(12, dtype=torch.float64), atol=1e-12)
    assert ((moved - target) ** 2).sum() < loss.detach()


def test_rounding_is_the_grid_and_passes_gradients() -> None:
    """The learner's rounding is XNNPACK's symmetric grid (codes in [-8, 7], bf16 scales), straight through."""
    w = torch.randn(4, 32, requires_grad=True)
    q = _rounded(w, GRID)
    scale = (w.detach().view(4, 2, 16).abs().amax(-1, keepdim=True) / 7.5).to(torch.bfloat16).float()
    codes = q.detach().view(4, 2, 16) / scale
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.min() >= -8 and codes.max() <= 7
    q.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_learned_rotations_are_exact_in_fp32_and_round_better_than_their_start(family_checkpoint) -> None:
    """A few steps on the text: the learned pair is orthogonal, the fp32 model rotated by it computes what the plain
    one does, the model is left as it was, and 4-bit rounding under it costs less KL on that text than under the
    Hadamard start."""
    model = _model(family_checkpoint, "llama")
    text = _text(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    teacher = unquantized_predictions(model, text)
    r1, r2 = _starts(model)
    q, q2, losses = learn_rotations(model, r1, r2, text, teacher, GRID, True, RotationLearning(steps=8, lr=1.5))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert model.norm_rotation is None and type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    for m in (q, q2):
        assert torch.allclose(m @ m.T, torch.eye(m.shape[0], dtype=torch.float64), atol=1e-10)
    assert not torch.allclose(q, r1, atol=1e-3)
    at_start = learn_rotations(model, r1, r2, text, teacher, GRID, True, RotationLearning(steps=2, lr=1e-12))[2]
    learned = learn_rotations(model, q, q2, text, teacher, GRID, True, RotationLearning(steps=2, lr=1e-12))[2]
    assert sum(learned) < sum(at_start), (learned, at_start)
    assert losses[0] == pytest.approx(at_start[0], rel=1e-4)

    tokens = text.windows[0]
    with torch.no_grad():
        model.reset_cache()
        plain = model(tokens, torch.tensor([0]), full_logits=True)
        rotated = copy.deepcopy(model)
        rotate(rotated, residual_and_heads=True, online_hadamard=True, keep_tied=True, learn=lambda a, b: (q, q2, "x"))
        rotated.reset_cache()
        got = rotated(tokens, torch.tensor([0]), full_logits=True)
    assert ((got - plain).abs().max() / plain.abs().max()).item() < 1e-5


@pytest.mark.parametrize("overrides,message", [
    (["quant=8da4w_rotated", "quant.rotation_steps=4"], "quant.rotation_steps=4: the steps of quant.rotation=learned"),
    (["quant=8da4w_rotated", "quant.rotation=learned", "quant.rotation_steps=0"], "at least 1"),
    (["quant=fp32", "quant.rotation=learned"], "has no integer linears"),
    (["model=gemma2", "quant=8da4w_rotated", "quant.rotation=learned"], "pre-norm decoders"),
])
def test_what_learning_cannot_do_is_refused_before_any_weight_is_read(family_checkpoint, tmp_path, overrides: list[str],
                                                                      message: str) -> None:
    from exporters.export import export
    from tests.helpers import compose_config

    if overrides[0] == "model=gemma2":
        overrides = [*overrides, f"model.checkpoint={family_checkpoint('gemma2')}"]
    with pytest.raises(UserError, match=message):
        export(compose_config(*overrides), tmp_path / "run")
    assert not list((tmp_path / "run").glob("*.pte"))
