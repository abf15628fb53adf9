"""Every quant scheme on every backend that can run here, plus Core ML and Vulkan lowering.

Each runnable export is run in the ExecuTorch runtime for a prompt and 16 greedy decode steps and
compared with the eager model quantized the same way, rebuilt independently of the pipeline.
"""

from __future__ import annotations

import pytest
import torch

from exporters.runtime import LoadedProgram
from tests.conftest import eager_model_of

DECODE_STEPS = 16
RUNNABLE = [
    ("portable", "fp16"), ("portable", "bf16"), ("portable", "fp32", "quant.embedding=4w"),
    ("portable", "fp32", "quant.embedding=8w", "quant.embedding_group_size=0"),
    ("xnnpack", "fp16"), ("xnnpack", "bf16"), ("xnnpack", "8da8w"), ("xnnpack", "8da4w_emb4w"),
    ("xnnpack", "8da4w", "quant.group_size=64", "quant.lm_head=8da8w", "quant.lm_head_group_size=0"),
]


def _export(exported, backend: str, quant: str, *extra: str):  # type: ignore[no-untyped-def]
    return exported(f"backend={backend}", f"quant={quant}", f"validation.decode_steps={DECODE_STEPS}",
                    "export.methods=[prefill,decode]", *extra)


@pytest.mark.parametrize("pair", RUNNABLE, ids=["-".join(p) for p in RUNNABLE])
def test_runtime_matches_the_quantized_eager_model(exported, pair: tuple[str, ...]) -> None:
    result = _export(exported, *pair)
    validation = result.manifest["validation"]
    assert validation["passed"] and validation["checked"] == "runtime"
    assert validation["decode_steps"] == DECODE_STEPS and validation["exact_token_agreement"] == 1.0

    # Independent of the pipeline's own check: rebuild the eager model and run the .pte ourselves.
    model = eager_model_of(result)
    program = LoadedProgram(result.pte_path)
    tolerance = result.manifest["config"]["quant"]["max_rel_error"]
    tokens = torch.randint(3, 384, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(tokens, torch.tensor([0]))
        got = program.run("prefill", tokens, torch.tensor([0]))[0]
        for pos in range(9, 9 + DECODE_STEPS):
            assert (got.float() - ref.float()).abs().max() <= tolerance * ref.float().abs().max(), f"position {pos}"
            assert int(got.argmax()) == int(ref.argmax()), f"greedy token at position {pos}"
            token = ref.argmax(-1).view(1, 1)
            ref = model(token, torch.tensor([pos]))
            got = program.run("decode", token, torch.tensor([pos]))[0]


@pytest.mark.parametrize("pair", RUNNABLE, ids=["-".join(p) for p in RUNNABLE])
def test_manifest_records_exactly_what_was_applied(exported, pair: tuple[str, ...]) -> None:
    q = _export(exported, *pair).manifest["quantization"]
    cfg = _export(exported, *pair).manifest["config"]["quant"]
    assert q["dtype"] == cfg["dtype"]
    for role in ("linear", "lm_head", "embedding"):
        applied = q[role]
        if cfg[role] is None:
            assert applied is None
        else:
            assert applied["scheme"] == cfg[role] and applied["torchao_config"].endswith("Config")
            assert applied["torchao_args"] and applied["layers"]


def test_lm_head_gets_its_own_scheme_and_untying_is_recorded(exported) -> None:
    m = _export(exported, *RUNNABLE[-1]).manifest["quantization"]
    assert m["linear"]["scheme"] == "8da4w" and "lm_head" not in m["linear"]["layers"]
    assert m["lm_head"]["scheme"] == "8da8w" and m["lm_head"]["torchao_args"]["weight_dtype"] == "torch.int8"
    assert m["untied_embeddings"] and "untied" in m["notes"][0]


@pytest.mark.xfail(strict=True, reason=(
    "known gap: const-prop (needed for quantized embeddings) folds lm_head's transpose of the tied matrix "
    "into a second, transposed constant; XNNPACK likewise keeps its own copy for lm_head"))
def test_unquantized_tied_embedding_is_stored_once_on_portable(exported) -> None:
    result = exported("backend=portable", "quant=fp32")
    assert not result.manifest["quantization"]["untied_embeddings"]
    model = eager_model_of(result)
    unique_bytes = sum(p.numel() * 4 for p in model.parameters())  # parameters() yields a tied tensor once
    embed_bytes = model.model.embed_tokens.weight.numel() * 4
    stored = result.manifest["program"]["storage"]["constant_buffer_bytes"]
    assert unique_bytes <= stored < unique_bytes + embed_bytes // 2


@pytest.mark.parametrize("backend", ["coreml", "vulkan"])
def test_static_shape_backends_lower_and_their_captured_programs_validate(exported, backend: str) -> None:
    result = exported(f"backend={backend}", "export.prefill_chunk=16", "export.methods=[prefill,decode]")
    m = result.manifest
    assert set(m["methods"]) == {"prefill", "decode"}
    assert m["methods"]["prefill"]["inputs"][0]["shape"] == [1, 16] and not m["methods"]["prefill"]["dynamic_tokens"]
    assert m["methods"]["decode"]["delegated_partitions"] >= 1
    assert m["validation"]["passed"]
    assert m["validation"]["checked"] == "captured programs (delegate cannot run on this host)"
    assert m["constant_methods"]["enable_dynamic_shape"] is False


def test_coreml_shares_weights_between_methods(exported) -> None:
    both = exported("backend=coreml", "export.prefill_chunk=16", "export.methods=[prefill,decode]")
    one = exported("backend=coreml", "export.prefill_chunk=16", "export.methods=[decode]")
    ratio = both.manifest["program"]["size_bytes"] / one.manifest["program"]["size_bytes"]
    assert ratio <= 1.02, f"Core ML two methods / one method = {ratio:.3f}"


def test_a_scheme_that_computes_garbage_cannot_pass(tmp_path) -> None:
    """XNNPACK runs weight-only 4w linears wrongly; forced past the config check, validation rejects it."""
    from exporters.api import export
    from exporters.errors import UserError, ValidationFailed
    from exporters.config import to_typed
    from tests.conftest import compose_config

    with pytest.raises(UserError, match="linear 4w, which backend=xnnpack cannot run"):
        to_typed(compose_config("quant=4w"))
    forced = compose_config("quant=4w", "backend.supported_linear=[null,4w]", "validation.decode_steps=4")
    with pytest.raises(ValidationFailed, match="does not match the eager model"):
        export(forced, tmp_path)
    assert not (tmp_path / "model.pte").exists() and (tmp_path / "model.rejected.pte").exists()
