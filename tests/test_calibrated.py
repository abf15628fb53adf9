"""Calibrated 4-bit (quant.algorithm=gptq, quant=8da4w_calibrated): the solver, the refusals, and a real export.

The solver is checked on real weights and real activations of SmolLM2 (a linear of its first layer, inputs from
the shipped calibration text) against HQQ on text calibration did not see; the export is the truncated real
model lowered to XNNPACK and run in the ExecuTorch runtime, as every other scheme.
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
    unseen_ids = torch.tensor([load_tokenizer(smollm2_truncated / "tokenizer.json").encode(UNSEEN)])
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


def test_calibrated_export_runs_in_the_runtime_records_its_text_and_keeps_the_size(real_exported) -> None:
    """quant=8da4w_calibrated on the real (truncated) model: validated in the runtime against its eager model
    like 8da4w, the same storage as 8da4w, and the manifest says how and on what it was calibrated."""
    calibrated = real_exported("quant=8da4w_calibrated", "export.methods=[prefill,decode]", "export.layout=split")
    plain = real_exported("quant=8da4w", "export.methods=[prefill,decode]", "export.layout=split")
    v = calibrated.manifest.validation
    assert v.passed and v.checked == "runtime", v.failures
    q = calibrated.manifest.quantization
    assert q.linear.algorithm == "gptq" and q.lm_head.algorithm == "gptq"
    assert q.linear.torchao_args["intx_choose_qparams_algorithm"] is None  # custom scales, as torchao names them
    assert q.calibration is not None and q.calibration.source == "exporters/data/calibration_text.txt"
    assert q.calibration.tokens >= MIN_CALIBRATION_TOKENS and len(q.calibration.sha256) == 64
    assert plain.manifest.quantization.linear.algorithm == "hqq" and plain.manifest.quantization.calibration is None
    # Same format: only codes and scales differ, so the file is the same size to within its graph's bytes.
    assert abs(calibrated.pte_path.stat().st_size / plain.pte_path.stat().st_size - 1) < 0.01
    # The program computes what its eager model computes, at least as closely as HQQ's (scales are bf16-exact).
    assert v.kl_mean <= plain.manifest.validation.kl_mean * 1.5
