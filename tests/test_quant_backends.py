"""Every quant scheme on every backend that can run here (XNNPACK, portable, OpenVINO), plus Core ML and Vulkan lowering.

Each runnable export is run in the ExecuTorch runtime for a prompt and 16 greedy decode steps and
compared with the eager model quantized the same way, rebuilt independently of the pipeline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exporters.runtime.driver import Driver
from exporters.runtime.programs import LoadedProgram
from models.tokenizer import load_tokenizer
from tests.helpers import compose_config, eager_model_of

# GPTQ codes and scales, with the layers that gain most per byte at 8 bits (exporters.quant.calibrated, .mixed).
CALIBRATED_MIXED = ("xnnpack", "8da4w_calibrated", "quant.size_budget=1.05")
# GPTQ's codes with scales learned against the unquantized model (exporters.quant.distill), a short learning.
LEARNED = ("xnnpack", "8da4w_learned", "quant.learning.steps=6")
# Kept out of the full run for its time (pytest -m extended): variants whose kernels another entry already runs.
EXTENDED = pytest.mark.extended
# Every quant option each runnable backend supports, on the real (truncated) SmolLM2. The default methods and layout,
# so the programs other files read (fp32, and 8da4w with its weights in model.ptd: stock runners) are these exports;
# where the weights live changes no kernel (tests/test_external_weights.py checks the bytes).
EIGHT_DA_FOUR_W = ("xnnpack", "8da4w", "export.weights=external")
RUNNABLE = [
    ("xnnpack", "fp32"), ("xnnpack", "fp16"), ("xnnpack", "bf16"), ("xnnpack", "8da8w"), EIGHT_DA_FOUR_W,
    ("xnnpack", "8da4w_emb4w"),
    ("xnnpack", "8da4w", "quant.group_size=64", "quant.lm_head=8da8w", "quant.lm_head_group_size=0"),
    CALIBRATED_MIXED, LEARNED,
    ("portable", "fp32"), ("portable", "fp16"), ("portable", "bf16"), ("portable", "fp32", "quant.embedding=4w"),
    ("portable", "fp32", "quant.embedding=8w", "quant.embedding_group_size=0"),
    # Fixed prompt length: prefill takes export.prefill_chunk tokens, the prompt below. The device computes in
    # bf16 here, and the 2-layer cut's perplexity (7e7) makes a relative drift ill-conditioned (tests/test_openvino.py).
    ("openvino", "fp32", "export.prefill_chunk=12", "quant.max_ppl_drift=0.1"),
    ("openvino", "fp16", "export.prefill_chunk=12", "quant.max_ppl_drift=0.1"),
]
# xnnpack bf16 the fp32 kernels on bf16 weights (fp16 has kernels of its own and stays); xnnpack 8da8w, and the
# group-size entry (4-bit blocks of 64, an 8-bit lm_head), the 4-bit blockwise kernels 8da4w runs and the 8-bit
# per-channel ones a quantized speech program's encoder runs (tests/test_speech.py); portable fp16 and bf16 the ATen
# kernels portable fp32 runs, in another dtype; portable's 4-bit and 8-bit embeddings the embedding op 8da4w_emb4w
# runs (outside the delegate, on the same kernels); OpenVINO fp16 what its fp32 runs (its device computes in bf16
# either way); GPTQ with a size budget the 4-bit kernels of 8da4w and the same 8-bit ones (its codes are checked to
# be XNNPACK's format eagerly: tests/test_calibrated.py); portable fp32 the kernels tests/test_export.py's portable
# program runs on the tiny model; xnnpack fp16 the kernels the sweeps' fp16 jobs run and validate (tests/test_sweeps.py,
# three programs on the tiny model); 8da4w_emb4w the 8da4w linears and the 4-bit embedding that
# tests/test_external_weights.py's 8da4w_emb4w programs run (tiny model, with their data files swapped); the learned
# scales the 8da4w kernels (the same torchao weight as GPTQ's; codes and bf16 scales checked eagerly in
# tests/test_distill.py).
SLOW_VARIANTS = {CALIBRATED_MIXED, LEARNED, ("xnnpack", "bf16"), ("xnnpack", "8da8w"), ("portable", "fp16"), ("portable", "bf16"),
                 ("xnnpack", "fp16"), ("xnnpack", "8da4w_emb4w"),
                 ("xnnpack", "8da4w", "quant.group_size=64", "quant.lm_head=8da8w", "quant.lm_head_group_size=0"),
                 ("portable", "fp32", "quant.embedding=4w"),
                 ("portable", "fp32", "quant.embedding=8w", "quant.embedding_group_size=0"),
                 ("openvino", "fp16", "export.prefill_chunk=12", "quant.max_ppl_drift=0.1"),
                 ("portable", "fp32")}
CASES = [pytest.param(p, id="-".join(p), marks=[EXTENDED] if p in SLOW_VARIANTS else []) for p in RUNNABLE]
PROMPT_LEN, DECODE_STEPS = 12, 16
OTHER_TEXT = ("People who build apps for phones want a language model that answers quickly, fits in memory and "
              "still writes sensible sentences. Choosing how to quantize it is a trade between those three.")


def _export(real_exported, backend: str, quant: str, *extra: str):  # type: ignore[no-untyped-def]
    # Static shapes (OpenVINO): prefill's fixed chunk and decode, as tests/test_openvino.py exports them.
    static = ["export.methods=[prefill,decode]", "export.layout=split"] if backend == "openvino" else []
    return real_exported(f"backend={backend}", f"quant={quant}", *static, *extra)


@pytest.mark.parametrize("pair", CASES)
def test_runtime_matches_the_quantized_eager_model(real_exported, pair: tuple[str, ...]) -> None:
    result = _export(real_exported, *pair)
    v = result.manifest.validation
    assert v.passed and v.checked == "runtime", v.failures
    tol = v.tolerance
    assert v.kl_mean <= tol["max_kl"] and v.top1_agreement >= tol["min_top1"]
    assert v.perplexity <= v.eager_perplexity * (1 + tol["max_ppl_drift"])

    # Independent of the pipeline's own check: rebuild the eager model, run the .pte ourselves on another
    # text and compare the distributions.
    model = eager_model_of(result)
    driver = Driver.of(LoadedProgram(result.pte_path))
    tokenizer = load_tokenizer(result.pte_path.parent / "tokenizer.json")
    tokens = torch.tensor([tokenizer.encode(OTHER_TEXT)[:PROMPT_LEN + DECODE_STEPS]])
    with torch.no_grad():
        ref = model(tokens, torch.tensor([0]), full_logits=True)[0, PROMPT_LEN - 1:-1].float()
        got = [driver.prefill(tokens[:, :PROMPT_LEN])]
        got += [driver.decode_one_token(tokens[:, p:p + 1], p) for p in range(PROMPT_LEN, tokens.shape[1] - 1)]
    got = torch.cat(got).float()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert kl.mean() <= tol["max_kl"] * 2, f"KL per position {kl.tolist()}"
    assert (got.argmax(-1) == ref.argmax(-1)).double().mean() >= tol["min_top1"] - 0.1


@pytest.mark.parametrize("pair", CASES)
def test_manifest_records_exactly_what_was_applied(real_exported, pair: tuple[str, ...]) -> None:
    manifest = _export(real_exported, *pair).manifest
    q, cfg = manifest.quantization, manifest.config["quant"]
    assert q.dtype == cfg["dtype"]
    for role in ("linear", "lm_head", "embedding"):
        applied = getattr(q, role)
        if cfg[role] is None:
            assert applied is None
        else:
            assert applied.scheme == cfg[role] and applied.torchao_config.endswith("Config")
            algorithm = cfg["embedding_algorithm" if role == "embedding" else "algorithm"]
            assert applied.algorithm == algorithm
            # torchao's own choice of scales, or none (custom: the calibrated codes and scales are given to it)
            assert str(applied.torchao_args["intx_choose_qparams_algorithm"]).lower().endswith(
                {"hqq": "hqq_scale_only", "gptq": "none", "distill": "none"}[algorithm])
            assert applied.layers and applied.fallbacks == {}
            assert set(applied.upgraded) <= set(q.mixed.upgraded if q.mixed else [])


def test_lm_head_gets_its_own_scheme_and_untying_is_recorded(smollm2_truncated: Path, tmp_path: Path) -> None:
    """The quantize stage's record, which the manifest carries (the group-size entry's program, whose runtime test
    runs with -m extended, needs no lowering for it)."""
    from exporters.export import run_stages

    backend, quant, *extra = RUNNABLE[6]
    cfg = compose_config("model=llama", f"model.checkpoint={smollm2_truncated}", f"backend={backend}",
                         f"quant={quant}", *extra, "validate=false")
    m = run_stages(cfg, tmp_path, stop_after="quantize")[1].quantization
    assert m.linear.scheme == "8da4w" and "lm_head" not in m.linear.layers
    assert m.lm_head.scheme == "8da8w" and m.lm_head.torchao_args["weight_dtype"] == "torch.int8"
    assert m.untied_embeddings and "untied" in m.notes[0]


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_unquantized_tied_embedding_is_stored_once(exported, backend: str) -> None:
    """The tied matrix is the largest of a small model (SmolLM2-135M: 113 MB in fp32): one copy, not two."""
    result = exported(f"backend={backend}", "quant=fp32")
    assert not result.manifest.quantization.untied_embeddings and result.manifest.validation.passed
    model = eager_model_of(result)
    unique_bytes = sum(p.numel() * 4 for p in model.parameters())  # parameters() yields a tied tensor once
    embed_bytes = model.model.embed_tokens.weight.numel() * 4
    storage = result.manifest.program.storage
    stored = storage["constant_buffer_bytes"] + storage["named_data_bytes"]  # the program's and the delegate's
    assert unique_bytes <= stored < unique_bytes + embed_bytes // 2
    assert "tied embedding stored once, lm_head reads it" in result.manifest.quantization.notes


def test_tied_embedding_copied_on_request(exported) -> None:
    """export.tied_embedding=copied: the backend's own copy for lm_head (faster on XNNPACK), same numbers."""
    shared, copied = exported("backend=portable", "quant=fp32"), exported("backend=portable", "quant=fp32",
                                                                          "export.tied_embedding=copied")
    model = eager_model_of(copied)
    embed_bytes = model.model.embed_tokens.weight.numel() * 4
    stored_shared, stored_copied = (r.manifest.program.storage["constant_buffer_bytes"] for r in (shared, copied))
    assert stored_copied >= stored_shared + embed_bytes
    assert copied.manifest.validation.passed
    assert copied.manifest.validation.perplexity == pytest.approx(shared.manifest.validation.perplexity)


# Vulkan cannot run here: its lowering alone, kept out of the full run for its time (Core ML's stays).
@pytest.mark.parametrize("backend", ["coreml", pytest.param("vulkan", marks=EXTENDED)])
def test_static_shape_backends_lower_and_their_captured_programs_validate(exported, backend: str) -> None:
    result = exported(f"backend={backend}", "export.prefill_chunk=16", "export.methods=[prefill,decode]", "export.layout=split")
    m = result.manifest
    assert set(m.methods) == {"prefill", "decode"}
    assert m.methods["prefill"].inputs[0].shape == [1, 16] and not m.methods["prefill"].dynamic_tokens
    assert m.methods["decode"].delegated_partitions >= 1
    assert m.validation.passed
    assert m.validation.checked == "undelegated programs"
    assert m.constant_methods["enable_dynamic_shape"] is False


def test_coreml_shares_weights_between_methods(exported) -> None:
    both = exported("backend=coreml", "export.prefill_chunk=16", "export.methods=[prefill,decode]", "export.layout=split")
    one = exported("backend=coreml", "export.prefill_chunk=16", "export.methods=[decode]", "export.layout=split")
    ratio = both.manifest.program.size_bytes / one.manifest.program.size_bytes
    assert ratio <= 1.02, f"Core ML two methods / one method = {ratio:.3f}"


def test_layers_a_group_size_does_not_divide_fall_back_and_are_recorded(exported) -> None:
    """intermediate_size=200: no group size XNNPACK takes divides down_proj's width, and 4-bit per row needs a
    multiple of 32 too, so those layers get the 8-bit scheme with one scale per row."""
    result = exported("model.arch.intermediate_size=200", "quant=8da4w", "export.methods=[decode]", "export.layout=split")
    q = result.manifest.quantization
    assert result.manifest.validation.passed
    down = [n for n in q.linear.layers if n.endswith("mlp.down_proj")]
    assert down and all(q.linear.layers[n] == 0 for n in down)
    assert q.linear.fallbacks == {n: "8da8w, one scale per row" for n in down}
    assert all(g == 32 for n, g in q.linear.layers.items() if n not in down)
    assert any("does not divide the width of 2 layer(s)" in note and "8da8w, one scale per row" in note
               for note in q.notes)


@pytest.mark.parametrize("width,requested,chosen", [(576, 32, 32), (576, 128, 96), (1536, 256, 256), (200, 32, 0),
                                                    (640, 0, 0), (320, 128, 64)])
def test_fallback_group_size_is_the_largest_multiple_of_32_that_divides(width: int, requested: int, chosen: int) -> None:
    from exporters.quant.schemes import group_size_for

    assert group_size_for(width, requested) == chosen


def test_algorithm_choice_changes_the_scales_and_is_recorded(tiny_checkpoint) -> None:
    """quant.algorithm=affine (min/max) and the default hqq give different int4 weights; the manifest says which."""
    from exporters.config import QuantConfig
    from exporters.quant.apply import quantize_model
    from models.checkpoint import build_model, open_checkpoint

    weights = {}
    for algorithm in ("hqq", "affine"):
        model = build_model(open_checkpoint(tiny_checkpoint), 32)
        applied = quantize_model(model, QuantConfig(name="q", linear="8da4w", lm_head="8da4w", lm_head_group_size=32,
                                                    algorithm=algorithm))
        assert applied.linear.algorithm == algorithm
        assert applied.linear.torchao_args["intx_choose_qparams_algorithm"].lower().endswith(
            "hqq_scale_only" if algorithm == "hqq" else "affine")
        weights[algorithm] = model.model.layers[0].mlp.down_proj.weight.dequantize()
    assert not torch.equal(weights["hqq"], weights["affine"])


def test_each_activation_is_quantized_once(smollm2_truncated, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """q/k/v read one activation and gate/up another: the captured program quantizes each once (torchao alone
    quantizes it per linear), and computes exactly the logits of the program that quantizes it per linear."""
    import copy

    from exporters.export import run_stages
    from exporters.quant.activations import share_activation_quantization
    from tests.helpers import REAL_LAYERS, compose_config

    cfg = compose_config("model=llama", f"model.checkpoint={smollm2_truncated}", "quant=8da4w", "validate=false",
                         "export.methods=[decode]", "export.layout=split")
    captured, _ = run_stages(cfg, tmp_path, stop_after="capture")
    spec = captured.methods.specs["decode"]
    with torch.no_grad():
        per_linear = torch.export.export(captured.model, spec.example_inputs,
                                         dynamic_shapes=spec.dynamic_shapes, strict=False)
    shared = copy.deepcopy(per_linear)
    assert share_activation_quantization(shared) > 0

    def quantized_activations(program) -> int:  # type: ignore[no-untyped-def]
        return sum(1 for n in program.graph.nodes if "choose_qparams_affine" in str(n.target))

    # Per layer: 7 linears (q, k, v, o, gate, up, down) read 4 distinct activations; plus lm_head.
    assert quantized_activations(per_linear) == 7 * REAL_LAYERS + 1
    assert quantized_activations(shared) == quantized_activations(captured.programs["decode"]) == 4 * REAL_LAYERS + 1
    token, position = torch.tensor([[42]]), torch.tensor([3])
    assert torch.equal(per_linear.module()(token, position), shared.module()(token, position))


@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 64), (8, 32)])
def test_hqq_by_rows_is_torchaos_hqq_bit_for_bit(smollm2_truncated, bits: int, group_size: int) -> None:  # type: ignore[no-untyped-def]
    """HQQ computed a block of rows at a time gives torchao's quantized values and scales exactly, on the real
    embedding and a real MLP weight cut into many blocks; ``hqq_by_rows`` swaps it in and restores torchao's."""
    from safetensors.torch import load_file
    from torchao.quantization.quant_primitives import _choose_qparams_and_quantize_scale_only_hqq
    from torchao.quantization.quantize_.workflows.intx import intx_unpacked_to_int8_tensor as intx

    from exporters.quant.hqq import hqq_by_rows, hqq_scale_only_by_rows

    weights = load_file(smollm2_truncated / "model.safetensors")
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"):
        weight = weights[name].float()
        expected_q, expected_scale = _choose_qparams_and_quantize_scale_only_hqq(weight, [1, group_size], qmin, qmax)
        q, scale = hqq_scale_only_by_rows(weight, [1, group_size], qmin, qmax, block_elements=1 << 18)
        assert weight.numel() > 1 << 18
        assert torch.equal(q, expected_q.to(torch.int8)), name
        assert torch.equal(scale, expected_scale), name
    original = intx._choose_qparams_and_quantize_scale_only_hqq
    with hqq_by_rows():
        assert intx._choose_qparams_and_quantize_scale_only_hqq is hqq_scale_only_by_rows
    assert intx._choose_qparams_and_quantize_scale_only_hqq is original


@EXTENDED  # GPTQ and the size budget's choices are tested eagerly in the full run (tests/test_calibrated.py)
def test_calibrated_mixed_program_records_its_text_and_choices_and_grows_as_estimated(real_exported) -> None:
    """quant=8da4w_calibrated quant.size_budget=1.05 (validated in the runtime by its export): GPTQ codes,
    the measured layers upgraded to 8 bits, the calibration text traced, and the file grown by the estimate."""
    from exporters.quant.calibration import MIN_CALIBRATION_TOKENS

    mixed = _export(real_exported, *CALIBRATED_MIXED)
    plain = _export(real_exported, "xnnpack", "8da4w")
    q = mixed.manifest.quantization
    assert q.linear.algorithm == q.lm_head.algorithm == "gptq"
    assert q.calibration is not None and q.calibration.source == "exporters/data/calibration_text.txt"
    assert q.calibration.tokens >= MIN_CALIBRATION_TOKENS and len(q.calibration.sha256) == 64
    assert plain.manifest.quantization.calibration is None and plain.manifest.quantization.mixed is None
    m = q.mixed
    assert m is not None and set(m.sensitivity) == set(q.linear.layers) | {"lm_head"}
    assert m.upgraded and m.uniform_bytes < m.chosen_bytes <= 1.05 * m.uniform_bytes
    assert {**q.linear.upgraded, **q.lm_head.upgraded} == {name: "8da8w" for name in m.upgraded}
    # The estimate counts packed int4 + bf16 scales against int8 + fp32 row scales: the file says the same.
    grown = mixed.pte_path.stat().st_size - plain.pte_path.stat().st_size
    estimated = m.chosen_bytes - m.uniform_bytes
    assert abs(grown - estimated) <= 0.05 * estimated + 64 * 1024, (grown, estimated)
