"""Rotations (quant.rotation, quant.online_hadamard): exact in fp32 for every family, then what they buy.

A rotation is fused into the weights (or applied at run time where it cannot be), so an fp32 model computes what
it did before, to float noise: checked eagerly for every family (with norm gains made non-trivial, which random
checkpoints leave at one), with tied and untied embeddings, with Gemma's sandwich norms and with a LoRA adapter,
and through the ExecuTorch runtime for one exported program.
"""

from __future__ import annotations

import copy

import pytest
import torch

from exporters.quant.calibration import CalibrationText
from exporters.quant.hadamard import factors, hadamard, random_rotation
from exporters.quant.rotation import MASSIVE_RATIO, massive_channels, rotate
from models.checkpoint import build_model, open_checkpoint
from models.decoder import CausalLM, RMSNorm
from tests.family_cases import FAMILY_CASES, HYBRID

TOKENS = 20


def test_the_widths_we_export_factor_into_small_hadamard_orders() -> None:
    """SmolLM2-135M (576, 1536), Qwen2.5-0.5B (896, 4864), Qwen2.5-1.5B (1536, 8960), Llama 3 (2048, 8192)."""
    assert {n: factors(n) for n in (576, 896, 1536, 4864, 8960, 2048, 8192)} == {
        576: (36, 16), 896: (28, 32), 1536: (12, 16, 8), 4864: (76, 64), 8960: (140, 64), 2048: (64, 32),
        8192: (32, 16, 16)}


@pytest.mark.parametrize("n", [2, 12, 20, 28, 36, 64, 76, 96, 140, 576, 896])
def test_hadamard_orders_are_hadamard(n: int) -> None:
    """H H^T = n I with +-1 entries: Sylvester's, both of Paley's constructions, and their Kronecker products."""
    h = hadamard(n)
    assert h is not None and set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    q, what = random_rotation(n, seed=0)
    assert "Hadamard" in what and torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)


def test_a_width_without_a_hadamard_gets_a_random_orthogonal_rotation() -> None:
    assert factors(6) is None and hadamard(6) is None  # 6 = 2 * 3: no Hadamard matrix of order 6 exists
    q, what = random_rotation(6, seed=0)
    assert what.startswith("random orthogonal") and torch.allclose(q @ q.T, torch.eye(6, dtype=torch.float64))


def _with_gains(model: CausalLM) -> CausalLM:
    """Non-trivial RMSNorm gains (a random checkpoint's are all one, or zero for Gemma's 1 + w): folding them is
    then tested, not skipped."""
    gen = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.data = torch.rand(module.weight.shape, generator=gen) * 1.5 + 0.25
    return model


@torch.no_grad()
def _logits(model: CausalLM, tokens: torch.Tensor) -> torch.Tensor:
    model.reset_cache()
    out = model(tokens, torch.tensor([0]), full_logits=True)
    model.reset_cache()
    return out


def _rotated_against_plain(model: CausalLM, text: CalibrationText | None = None, **options: bool) -> float:
    tokens = torch.randint(0, model.args.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    plain = _logits(model, tokens)
    rotated = copy.deepcopy(model)
    tied = rotated.lm_head.weight is rotated.model.embed_tokens.weight
    rotate(rotated, residual_and_heads=options.get("residual", True), online_hadamard=options.get("online", True),
           keep_tied=tied, massive_in=text, seed=0)
    assert not torch.equal(rotated.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight)
    return ((_logits(rotated, tokens) - plain).abs().max() / plain.abs().max()).item()


# Hybrid models' recurrent layers are not rotated: refused by name (tests/test_hybrid.py); nor are Gemma 4's layers of
# several shapes (tests/test_gemma4.py).
@pytest.mark.parametrize("family", [f for f in FAMILY_CASES if f not in HYBRID and f != "gemma4"])
def test_rotation_in_fp32_computes_what_the_plain_model_does(family_checkpoint, family: str) -> None:
    """R1 and R2 fused, R4 online (and, for tied embeddings and Gemma 2/3's sandwich norms, R1 at run time): the
    logits of every position within float noise of the unrotated model's, on prefill and through the cache."""
    model = _with_gains(build_model(open_checkpoint(family_checkpoint(family)), 48))
    assert _rotated_against_plain(model) < 1e-5


def test_an_untied_copy_of_a_tied_embedding_is_rotated_in_place(family_checkpoint) -> None:
    """When quantization unties the embedding (lm_head quantized, the embedding not), both matrices are rotated
    offline: no run-time matrix."""
    model = _with_gains(build_model(open_checkpoint(family_checkpoint("qwen2")), 48))
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.tied_head = False
    tokens = torch.randint(0, model.args.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    plain = _logits(model, tokens)
    record = rotate(model, residual_and_heads=True, online_hadamard=False, keep_tied=False)
    assert model.embed_rotation is None and model.norm_rotation is None and record.online == []
    assert ((_logits(model, tokens) - plain).abs().max() / plain.abs().max()).item() < 1e-5


def test_massive_channels_stay_in_place_with_their_gains(family_checkpoint) -> None:
    """A residual channel far above the others (planted here in the embedding, as SmolLM2's channel 507 reaches
    300x the median channel's peak) is found on the text and left out of R1, its norm gains kept in the norms;
    the rotated model still computes what the plain one does."""
    model = _with_gains(build_model(open_checkpoint(family_checkpoint("qwen2")), 48))
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())  # untied: R1 fused
    model.tied_head = False
    model.model.embed_tokens.weight.data[:, 5] *= 4 * MASSIVE_RATIO / model.model.embed_tokens.weight[:, 5].abs().mean()
    text = CalibrationText("test", "", [torch.arange(1, 33)[None]])
    channels, ratio = massive_channels(model, text)
    assert channels == [5] and ratio > MASSIVE_RATIO
    gains = [layer.input_layernorm.weight[5].item() for layer in model.model.layers]
    assert _rotated_against_plain(model, text) < 1e-5
    rotated = copy.deepcopy(model)
    record = rotate(rotated, residual_and_heads=True, online_hadamard=False, keep_tied=False, massive_in=text)
    assert record.massive_channels == [5] and "1 massive channel(s) kept in place" in (record.residual or "")
    assert [layer.input_layernorm.weight[5].item() for layer in rotated.model.layers] == gains
    assert torch.equal(rotated.model.layers[0].input_layernorm.weight[:5], torch.ones(5))


@pytest.mark.parametrize("residual,online", [(True, False), (False, True)])
def test_each_rotation_alone_is_exact(family_checkpoint, residual: bool, online: bool) -> None:
    model = _with_gains(build_model(open_checkpoint(family_checkpoint("phi3")), 48))
    assert _rotated_against_plain(model, residual=residual, online=online) < 1e-5


def test_an_adapter_turns_with_its_layers(family_checkpoint) -> None:
    """A LoRA adapter on every linear (random A and B, PEFT's own layers): with it active, the rotated model still
    computes what the plain one does (A rotated as its layer's inputs, B as its outputs)."""
    from peft import LoraConfig, inject_adapter_in_model

    from models.lora import active_adapter

    model = _with_gains(build_model(open_checkpoint(family_checkpoint("llama")), 48))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False), model,
                            adapter_name="style")
    with active_adapter(model, "style"):
        assert _rotated_against_plain(model) < 1e-5


# Phi-3 (fused projections) with -m extended: its rotation is exact eagerly above, and Gemma 2's program runs R4's
# delegated matmuls here.
@pytest.mark.parametrize("family", ["gemma2", pytest.param("phi3", marks=pytest.mark.extended)])
def test_a_rotated_fp32_program_computes_what_transformers_does(exported, family_checkpoint, family: str) -> None:
    """Through the ExecuTorch runtime: Gemma 2 (tied embedding and sandwich norms: R1 at run time, soft-capped
    logits) and Phi-3 (fused projections, untied), with R4 at run time, against transformers' unrotated model on
    the prompt and every greedy decode step (one forward method, as the families' parity tests); validation's perplexity equals the unrotated baseline's."""
    from exporters.runtime.programs import LoadedProgram
    from tests.test_families import DECODE_STEPS, MAX_SEQ_LEN, PARITY_METHODS, prompt_ids, run_greedy, transformers_model

    ckpt = family_checkpoint(family)
    result = exported(f"model={family}", f"model.checkpoint={ckpt}", "backend=xnnpack", "quant=fp32",
                      "quant.rotation=hadamard", "quant.online_hadamard=true", f"export.methods={PARITY_METHODS}",
                      "export.layout=split", f"export.max_seq_len={MAX_SEQ_LEN}")
    rotation = result.manifest.quantization.rotation
    assert rotation is not None and rotation.residual and rotation.heads
    assert len(rotation.online) == (3 if family == "gemma2" else 1)  # post-norms, tied embedding, down_proj
    validation = result.manifest.validation
    assert abs(validation.perplexity / validation.baseline_perplexity - 1) < 1e-5
    ref = transformers_model(ckpt)
    with torch.no_grad():
        steps = list(run_greedy(LoadedProgram(result.pte_path), lambda t: ref(t).logits[0, -1], prompt_ids(ckpt)))
    assert len(steps) == DECODE_STEPS + 1
    for i, (got, expected) in enumerate(steps):
        assert (got - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item()), f"step {i}"
