"""Distilled scales (quant.algorithm=distill, quant=8da4w_learned): GPTQ's codes, every group scale learned against
the unquantized model's predictions.

On tiny models through the real conf tree: the hand-written backward is autograd's, the codes stay GPTQ's and the
scales XNNPACK's bf16, learning lowers the KL to the unquantized model, and the recurrent families learn through
their mixers too. Its quality on the real models is measured in docs/quality.md#learned-4-bit; its program (the same
torchao weight and XNNPACK kernels as GPTQ's) is run in the runtime by tests/test_quant_backends.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from exporters.config import QuantConfig, Source
from exporters.quant.apply import quantize_model
from exporters.quant.distill import _CodesTimesScales, int8_per_token
from models.checkpoint import build_model, open_checkpoint
from tests.helpers import compose_config

MAX_SEQ_LEN = 64


def _quant(*overrides: str) -> QuantConfig:
    cfg = compose_config(*overrides).quant
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConfig), cfg))  # type: ignore[return-value]


def _quantized(checkpoint: Path, quant: QuantConfig):  # type: ignore[no-untyped-def]
    """The model quantized by ``quant`` on its calibration text, the record, and that text."""
    from exporters.components.language_model import read_calibration

    ckpt = open_checkpoint(checkpoint)
    model = build_model(ckpt, MAX_SEQ_LEN)
    text = read_calibration(quant.calibration, Source.tiny, model, ckpt)
    record = quantize_model(model, quant, calibration=lambda: text)
    return model, record, text


def _kl_to(reference: torch.nn.Module, model: torch.nn.Module, windows: list[torch.Tensor]) -> float:
    """Mean KL divergence from ``reference``'s next-token distributions to ``model``'s over ``windows``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            p, q = [F.log_softmax(m(window, torch.tensor([0]), full_logits=True)[0].float(), dim=-1)
                    for m in (reference, model)]
            total += float((p.exp() * (p - q)).sum())
            count += window.shape[1]
            reference.reset_cache()
            model.reset_cache()
    return total / count


@pytest.mark.parametrize("rounded", [False, True])
def test_the_backward_is_autograds_without_a_float_weight(rounded: bool) -> None:
    """The hand-written backward (the weight recomputed from int8 codes) gives autograd's gradients of the plain
    expression, the activations' int8 rounding passed straight through."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, 64, generator=g, requires_grad=True)
    codes = torch.randint(-8, 8, (24, 64), generator=g, dtype=torch.int8)
    scales = (torch.rand(24, 2, generator=g) + 0.5).requires_grad_()
    ours = _CodesTimesScales.apply(x, codes, scales, 32, rounded)
    ours.square().sum().backward()
    grads = x.grad.clone(), scales.grad.clone()
    x.grad = scales.grad = None
    xq = x + (int8_per_token(x) - x).detach() if rounded else x
    plain = F.linear(xq, (codes.view(24, 2, 32).float() * scales[..., None]).view(24, 64))
    plain.square().sum().backward()
    torch.testing.assert_close(ours, plain)
    torch.testing.assert_close(grads[0], x.grad)
    torch.testing.assert_close(grads[1], scales.grad)


def test_before_learning_it_computes_what_the_quantized_linear_computes() -> None:
    """A DistilledLinear around a torchao 8da4w linear gives that linear's eager output exactly: the same int8
    activation rounding, the same codes and scales (what learning starts from is the quantized model)."""
    from exporters.quant.calibrated import Target
    from exporters.quant.distill import DistilledLinear
    from exporters.quant.schemes import LINEAR_SCHEMES

    g = torch.Generator().manual_seed(1)
    scheme = LINEAR_SCHEMES["8da4w"]
    linear = torch.nn.Linear(64, 24, bias=False)
    codes = torch.randint(-8, 8, (24, 64), generator=g, dtype=torch.int8)
    scales = (torch.rand(24, 2, generator=g) / 10).to(torch.bfloat16).float()
    linear.weight = torch.nn.Parameter(scheme.weight(codes, scales, 32, torch.float32), requires_grad=False)
    x = torch.randn(1, 7, 64, generator=g) * 3
    with torch.no_grad():
        expected = linear(x)
        ours = DistilledLinear(linear, Target(linear, scheme, 32))(x)
    assert torch.equal(ours, expected)


def test_distilled_scales_keep_gptqs_codes_in_xnnpacks_format_and_lower_the_kl(tiny_checkpoint: Path) -> None:
    """quant=8da4w_learned against quant=8da4w_calibrated on the same text: every linear keeps GPTQ's codes, its scales
    move and stay bf16 (XNNPACK stores them so), the record says distill with its steps, and the model's KL to the
    unquantized model on the calibration text is lower."""
    gptq, gptq_record, text = _quantized(tiny_checkpoint, _quant("quant=8da4w_calibrated"))
    learned, record, _ = _quantized(tiny_checkpoint, _quant("quant=8da4w_learned", "quant.learning.steps=48"))
    assert record.linear.algorithm == record.lm_head.algorithm == "distill"
    c = record.calibration
    assert c is not None and c.steps == 48 and gptq_record.calibration.steps is None
    assert c.kl_last_pass < c.kl_first_pass and "KL to the unquantized model" in record.describe()
    moved = 0
    for name, module in learned.named_modules():
        if isinstance(module, torch.nn.Linear):
            ours, theirs = module.weight, gptq.get_submodule(name).weight
            assert type(ours).__name__ == "IntxUnpackedToInt8Tensor" and ours.block_size == theirs.block_size
            assert torch.equal(ours.qdata, theirs.qdata), name
            assert torch.equal(ours.scale, ours.scale.to(torch.bfloat16).float()), name
            moved += not torch.equal(ours.scale, theirs.scale)
    assert moved >= 10, moved
    reference = build_model(open_checkpoint(tiny_checkpoint), MAX_SEQ_LEN)
    assert _kl_to(reference, learned, text.windows) < 0.9 * _kl_to(reference, gptq, text.windows)


def test_short_convolutions_pass_gradients(family_checkpoint) -> None:
    """LFM2's short convolutions (ATen ops) pass gradients: their projections' scales move too."""
    gptq, _, _ = _quantized(family_checkpoint("lfm2"), _quant("model=lfm2", "quant=8da4w_calibrated"))
    learned, record, _ = _quantized(family_checkpoint("lfm2"),
                                    _quant("model=lfm2", "quant=8da4w_learned", "quant.learning.steps=6"))
    assert record.linear.algorithm == "distill"
    convolutions = [i for i, layer in enumerate(learned.model.layers) if layer.mixer.value == "short_conv"]
    for i in convolutions:
        for name in (f"model.layers.{i}.conv.in_proj", f"model.layers.{i}.conv.out_proj"):
            assert not torch.equal(learned.get_submodule(name).weight.scale, gptq.get_submodule(name).weight.scale)


def test_gated_deltanet_is_refused_before_loading(family_checkpoint, tmp_path: Path) -> None:
    """Qwen3.5's Gated DeltaNet kernel has no gradient: refused before any weight is read, with what works instead."""
    from exporters.errors import UserError
    from exporters.export import run_stages

    cfg = compose_config("model=qwen3_5", f"model.checkpoint={family_checkpoint('qwen3_5')}", "quant=8da4w_learned")
    with pytest.raises(UserError, match=r"Gated DeltaNet.*no gradient.*quant=8da4w_calibrated"):
        run_stages(cfg, tmp_path, stop_after="load")
    assert not list(tmp_path.glob("*.pte"))
