"""Calibrated 4-bit (quant.algorithm=gptq, quant=8da4w_calibrated) and mixed precision (quant.size_budget): the
solver, the layer choice, the refusals.

The solver is checked on real weights and real activations of SmolLM2 (a linear of its first layer, inputs from
the shipped calibration text) against HQQ on text calibration did not see. The real exports (the truncated real
model lowered to XNNPACK and run in the ExecuTorch runtime, as every other scheme) are in
tests/test_quant_backends.py, beside the plain 8da4w program they are compared with.
"""

from __future__ import annotations

import pytest
import torch

from exporters.errors import UserError
from exporters.export import checked_config
from exporters.quant.calibration import MIN_CALIBRATION_TOKENS
from exporters.quant.gptq import IntGrid, gptq
from exporters.quant.hqq import hqq_scale_only_by_rows
from exporters.quant.schemes import LINEAR_SCHEMES
from tests.helpers import compose_config

UNSEEN = ("The bus to the coast left at seven, and most of the passengers slept until the road began to climb "
          "through the pine forest. Near the top a driver coming the other way flashed his lights: a tree had "
          "fallen across the lane, and it took an hour and four strong volunteers to drag it clear. ") * 3


def _dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, cols = codes.shape
    return (codes.view(rows, scales.shape[1], -1).float() * scales.unsqueeze(-1)).view(rows, cols)


def test_gptq_codes_are_xnnpacks_format_and_beat_hqq_on_unseen_text(smollm2_truncated) -> None:
    """On a real layer: codes in [-8, 7], bf16-exact group scales, and a smaller output error than HQQ on inputs
    from text calibration never saw; the torchao tensor built from them holds exactly those values."""
    from exporters.export import run_stages
    from exporters.quant.calibration import calibration_text
    from exporters.config import CalibrationConfig

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        loaded, ctx = run_stages(compose_config("model=llama", f"model.checkpoint={smollm2_truncated}",
                                                "validate=false"), tmp, stop_after="load")
    model = loaded.model
    text = calibration_text(CalibrationConfig(), None, ctx.checkpoint, model.args.vocab_size, model.args.max_context_len)
    assert text.tokens >= MIN_CALIBRATION_TOKENS and len(text.sha256) == 64
    layer = model.model.layers[0]
    seen: list[torch.Tensor] = []
    hook = layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    from models.tokenizer import load_tokenizer
    unseen_ids = torch.tensor([load_tokenizer(smollm2_truncated / "tokenizer.json").encode(UNSEEN)
                               [:model.args.max_context_len]])
    with torch.no_grad():
        for window in text.windows:
            model.reset_cache()
            model(window, torch.tensor([0]), full_logits=True)
        calibration_inputs = torch.cat(seen)
        seen.clear()
        model.reset_cache()
        model(unseen_ids, torch.tensor([0]), full_logits=True)
    hook.remove()
    unseen_inputs = torch.cat(seen)
    weight = layer.self_attn.q_proj.weight.detach()
    codes, scales = gptq(weight, calibration_inputs.T @ calibration_inputs, calibration_inputs.shape[0],
                         IntGrid(-8, 7, 32))
    assert codes.dtype == torch.int8 and int(codes.min()) >= -8 and int(codes.max()) <= 7
    assert torch.equal(scales, scales.to(torch.bfloat16).float()), "XNNPACK stores group scales as bf16"
    hqq_codes, hqq_scales = hqq_scale_only_by_rows(weight, [1, 32], -8, 7)

    def error(w: torch.Tensor) -> float:
        ref = unseen_inputs @ weight.T
        return float(((unseen_inputs @ w.T - ref) ** 2).sum() / (ref ** 2).sum())

    assert error(_dequantize(codes, scales)) < 0.7 * error(_dequantize(hqq_codes, hqq_scales))
    tensor = LINEAR_SCHEMES["8da4w"].weight(codes, scales, 32, torch.float32)
    assert torch.equal(tensor.dequantize(), _dequantize(codes, scales))


@pytest.mark.parametrize("overrides,named", [
    (["quant=8da4w_calibrated", "quant.calibration.text_file=/nonexistent/text.txt"],
     "quant.calibration.text_file=/nonexistent/text.txt: no such file"),
    (["quant=8da4w_calibrated", "quant.calibration.max_tokens=100"], "at least 512 tokens"),
    (["quant=8da4w", "quant.embedding=4w", "quant.embedding_algorithm=gptq"], "lookup table"),
    (["quant=fp32", "quant.algorithm=gptq"], "has none in its linear layers or lm_head"),
    (["quant=8da4w", "quant.size_budget=0.9"], "smallest program it can make is the uniform one"),
    (["quant=8da8w", "quant.size_budget=1.05"], "has no 4-bit linears"),
    (["quant=8da4w", "quant.size_budget=1.05", "quant.calibration.max_tokens=10"], "at least 512 tokens"),
    (["quant=8da4w_calibrated", "quant.learning.steps=10"], "only quant.algorithm=distill and signround learn"),
    (["quant=8da4w_calibrated", "quant.algorithm=signround", "quant.learning.steps=0"], "at least one step"),
    (["quant=8da4w_calibrated", "quant.algorithm=signround", "quant.learning.lr=0.9"], "use a value in"),
    (["quant=8da4w", "quant.learning.rounding=true"], "only quant.algorithm=distill and signround learn"),
    (["quant=8da4w_learned", "quant.learning.rounding=true"], "only quant.algorithm=signround learns each weight"),
    (["quant=8da4w_learned", "quant.learning.lr=0.5"], r"Adam moves the log.*\(0, 0.1\]"),
    (["quant=8da4w_learned", "quant.learning.steps=0"], "at least one step"),
])
def test_calibration_that_cannot_work_is_refused_before_any_work(overrides: list[str], named: str) -> None:
    with pytest.raises(UserError, match=named):
        checked_config(compose_config(*overrides))


@pytest.mark.parametrize("content,named", [("", "is empty"), ("Too short to learn from. " * 20, "words")])
def test_an_empty_or_short_calibration_text_is_refused(tmp_path, content: str, named: str) -> None:
    text = tmp_path / "calibration.txt"
    text.write_text(content)
    with pytest.raises(UserError, match=named) as refused:
        checked_config(compose_config("quant=8da4w_calibrated", f"quant.calibration.text_file={text}"))
    assert "quant.calibration.text_file" in str(refused.value)


def test_the_old_qparams_key_names_its_new_name() -> None:
    with pytest.raises(UserError, match="quant.qparams was renamed quant.algorithm"):
        checked_config(compose_config("+quant.qparams=hqq"))


def test_upgrades_go_to_the_most_kl_saved_per_byte_within_the_allowance() -> None:
    from torch import nn

    from exporters.quant.mixed import Candidate, Precision, Sensitivity, choose_upgrades

    low, high = Precision("8da4w", LINEAR_SCHEMES["8da4w"], 32), Precision("8da8w", LINEAR_SCHEMES["8da8w"], 0)
    candidates = {name: Candidate(nn.Linear(cols, 64, bias=False), low, high)
                  for name, cols in (("big", 512), ("small", 64), ("useless", 64), ("medium", 256))}
    # 4-bit at group 32: 0.5 B per weight + 2 B per 32; 8-bit per row: 1 B per weight + 4 B per row.
    assert candidates["small"].extra_bytes == (64 * 64 + 64 * 4) - (64 * 64 // 2 + 64 * 2 * 2)
    sensitivity = {"big": Sensitivity(0.080, 0.001), "small": Sensitivity(0.020, 0.001),
                   "useless": Sensitivity(0.001, 0.002), "medium": Sensitivity(0.010, 0.001)}
    per_byte = {n: (s.kl_low - s.kl_high) / candidates[n].extra_bytes for n, s in sensitivity.items()}
    assert per_byte["small"] > per_byte["big"] > per_byte["medium"]
    extra = {n: c.extra_bytes for n, c in candidates.items()}
    # Room for "small" and "big" only; "medium" does not fit after them; "useless" gains nothing at any price.
    assert choose_upgrades(candidates, sensitivity, extra["small"] + extra["big"] + 10) == ["small", "big"]
    # "big" does not fit, the next one that does is taken.
    assert choose_upgrades(candidates, sensitivity, extra["small"] + extra["medium"]) == ["small", "medium"]
    assert choose_upgrades(candidates, sensitivity, 10 ** 9) == ["small", "big", "medium"]
    assert choose_upgrades(candidates, sensitivity, 0) == []


def test_size_budget_gives_8_bits_to_measured_layers_and_records_them(tmp_path) -> None:
    """On the tiny model: every 4-bit linear and lm_head measured at 4 and 8 bits; the upgraded ones really hold
    8-bit codes with one scale per row, the rest 4-bit groups, and the estimate stays within the budget."""
    from exporters.export import run_stages

    quantized, ctx = run_stages(compose_config("quant=8da4w", "quant.size_budget=1.2"), tmp_path, stop_after="quantize")
    q = ctx.quantization
    mixed = q.mixed
    assert mixed is not None and mixed.budget == 1.2
    assert set(mixed.sensitivity) == set(q.linear.layers) | {"lm_head"}
    assert all(low >= 0 and high >= 0 for low, high in mixed.sensitivity.values())
    assert mixed.upgraded and mixed.chosen_bytes <= 1.2 * mixed.uniform_bytes < mixed.all_high_bytes
    assert all(mixed.sensitivity[n][0] > mixed.sensitivity[n][1] for n in mixed.upgraded)
    modules = dict(quantized.model.named_modules())
    for name, group in q.linear.layers.items():
        weight = modules[name].weight
        if name in mixed.upgraded:
            assert q.linear.upgraded[name] == "8da8w" and group == 0
            assert weight.target_dtype == torch.int8 and weight.block_size[1] == weight.shape[1]
        else:
            assert name not in q.linear.upgraded and group == 32
            assert weight.target_dtype == torch.int4 and weight.block_size[1] == 32
    assert "mixed precision" in q.describe() and f"{len(mixed.upgraded)} of" in q.describe()
