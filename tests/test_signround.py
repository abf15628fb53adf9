"""Learned scales (quant.algorithm=signround): what they learn through, and what they store.

On the tiny model: the layer learns through ExecuTorch's attention kernels' ATen twin (they have no gradient), the
codes and scales it stores are XNNPACK's format, and learning lowers the layer's output error on the calibration
text. Its quality on the real SmolLM2 is measured in docs/quality.md#learned-4-bit (short of GPTQ's there yet);
its codes go through the same torchao weight and XNNPACK kernels as GPTQ's, whose programs tests/test_quant_backends.py
runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exporters.config import CalibrationConfig, Source
from exporters.quant.calibrated import Target
from exporters.quant.calibration import LayerByLayer
from exporters.quant.schemes import LINEAR_SCHEMES
from exporters.quant.learning import differentiable_attention
from exporters.quant.signround import Learning, quantize_learned
from models.checkpoint import build_model, open_checkpoint


def _model(checkpoint: Path, attention: str = "custom_ops"):  # type: ignore[no-untyped-def]
    model = build_model(open_checkpoint(checkpoint), 64, attention=attention).float()
    model.init_buffers()
    return model


def test_attention_learns_through_the_aten_twin_of_the_kernels(tiny_checkpoint: Path) -> None:
    """The same output as ExecuTorch's custom_sdpa, and gradients reach q, k and v (the kernel passes none)."""
    model = _model(tiny_checkpoint)
    layer = model.model.layers[0]
    positions = torch.arange(12)
    inputs = model.layer_inputs(positions, torch.float32)[0]
    x = torch.randn(1, 12, model.args.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        kernel = layer(x, inputs.rope, positions, inputs.mask, inputs.slots)
    with differentiable_attention(layer, torch.float32):
        assert type(layer.self_attn).__name__ == "_LearningAttention"
        learned = layer(x, inputs.rope, positions, inputs.mask, inputs.slots)
        learned.square().sum().backward()
    assert type(layer.self_attn).__name__ == "CustomOpsAttention"  # given back
    torch.testing.assert_close(learned.detach(), kernel, atol=1e-5, rtol=1e-5)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        grad = getattr(layer.self_attn, name).weight.grad
        assert grad is not None and grad.abs().sum() > 0, name


# Kept out of the full run for its time (pytest -m extended): signround is the experimental form; the preset's learning
# (quant.algorithm=distill) and its format are tested in tests/test_distill.py, through the same ATen attention.
@pytest.mark.extended
def test_learned_codes_are_xnnpacks_format_and_lower_the_layers_error(tiny_checkpoint: Path) -> None:
    """Codes in [-8, 7] with bf16 group scales, as the torchao weight XNNPACK lowers; more steps, a smaller error of
    each layer's output against the unquantized layer's on the calibration text."""
    from exporters.components.language_model import read_calibration

    reference = _model(tiny_checkpoint)
    text = read_calibration(CalibrationConfig(), Source.tiny, reference, open_checkpoint(tiny_checkpoint))

    def learned(steps: int, rounding: bool = False):  # type: ignore[no-untyped-def]
        model = _model(tiny_checkpoint)
        targets = {n: Target(m, LINEAR_SCHEMES["8da4w"], 32) for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")}
        quantize_learned(model, targets, text, Learning(steps, rounding=rounding), lambda: None)
        return model

    def error(model) -> float:  # type: ignore[no-untyped-def]
        with torch.no_grad():
            ours, theirs = LayerByLayer(model, text.windows), LayerByLayer(reference, text.windows)
            a, b = ours.embedded, theirs.embedded
            for i in range(len(model.model.layers)):
                a, b = ours.layer(i, a), theirs.layer(i, b)
        return float(sum(((x - y) ** 2).sum() for x, y in zip(a, b)) / sum((y ** 2).sum() for y in b))

    once, longer, rounded = learned(1), learned(40), learned(40, rounding=True)
    weight = longer.model.layers[0].mlp.down_proj.weight
    assert type(weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert int(weight.qdata.min()) >= -8 and int(weight.qdata.max()) <= 7
    assert torch.equal(weight.scale, weight.scale.to(torch.bfloat16).float()), "XNNPACK stores group scales as bf16"
    assert weight.block_size == (1, 32)
    assert error(longer) < 0.9 * error(once) and error(rounded) < 0.9 * error(once)
