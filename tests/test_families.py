"""Every model family against transformers' own implementation of it.

For each family a tiny config (``tests/family_cases.py``) is built and saved by transformers, with a
tokenizer trained here. The decoder must match transformers eagerly, and the exported XNNPACK
program, run in the ExecuTorch runtime, must match it on prefill and on every decode step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from exporters.context.artifacts import ExportResult
from exporters.runtime.driver import Driver
from exporters.runtime.programs import LoadedProgram
from models.checkpoint import build_model, open_checkpoint
from models.decoder import CausalLM
from models.errors import ModelError
from models.families import FAMILIES
from models.tokenizer import find_tokenizer, load_tokenizer
from tests.helpers import assert_matches_transformers, compose_config, copy_checkpoint, eager_model_of
from tests.family_cases import FAMILY_CASES

FAMILY_NAMES = list(FAMILY_CASES)
# Families whose decoder transformers builds only inside a vision-language model (no causal-LM class to write a text
# checkpoint with): their parity tests are tests/test_qwen_vl.py's.
VISION_ONLY = ("qwen2_5_vl", "qwen3_vl")
SLIDING = ["mistral", "qwen2", "gemma2", "gemma3", "gemma4", "ministral3", "olmo3"]
MAX_SEQ_LEN, DECODE_STEPS = 48, 10
PROMPT = "The model was exported with ExecuTorch and shipped in an app."


def test_every_registered_family_has_a_case_and_a_config_option() -> None:
    from exporters.config import CONF_DIR

    assert set(FAMILY_CASES) | set(VISION_ONLY) == set(FAMILIES)
    # One conf/model/<family>.yaml per registered family (each keeps its comment on which checkpoints it
    # covers), and each selects exactly its own family: the files cannot drift from the registry.
    options = {p.stem for p in (CONF_DIR / "model").glob("*.yaml")} - {"hf", "auto", "tiny"}
    assert options == set(FAMILIES)
    for name in FAMILIES:
        model = compose_config(f"model={name}").model
        assert (model.name, model.family, model.source) == (name, name, "hf"), name


def transformers_model(ckpt: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("attention", ["aten", "custom_ops"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_decoder_matches_transformers(family_checkpoint, family: str, attention: str) -> None:
    ckpt = family_checkpoint(family)
    ref = transformers_model(ckpt)
    ours = build_model(open_checkpoint(ckpt), MAX_SEQ_LEN, attention=attention)
    if attention == "custom_ops" and ours.args.custom_ops_blockers():
        assert ours.args.attention == "aten", "a model the kernel cannot compute falls back to ATen attention"
    tokens = torch.randint(0, ours.args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    assert_matches_transformers(ref, ours, tokens, prefill_len=12)


def test_custom_ops_kernel_takes_gemma3_when_the_window_covers_the_context(family_checkpoint) -> None:
    """With export.max_seq_len <= sliding_window every layer is plain causal, so the fast kernel is used
    (with Gemma's query_pre_attn_scalar scale and q/k norms) and still matches transformers."""
    ckpt = family_checkpoint("gemma3")
    window = FAMILY_CASES["gemma3"]["sliding_window"]
    ours = build_model(open_checkpoint(ckpt), window, attention="custom_ops")
    assert ours.args.attention == "custom_ops" and ours.args.scale != ours.args.head_dim**-0.5
    tokens = torch.randint(0, ours.args.vocab_size, (1, window), generator=torch.Generator().manual_seed(0))
    assert_matches_transformers(transformers_model(ckpt), ours, tokens, prefill_len=3)


@pytest.mark.parametrize("family", SLIDING)
def test_sliding_windows_really_mask(family_checkpoint, family: str) -> None:
    """Negative control: the same weights without the windows give other logits past the window."""
    model = build_model(open_checkpoint(family_checkpoint(family)), MAX_SEQ_LEN)
    assert any(w is not None for w in model.args.layer_window)
    unwindowed = CausalLM(dataclasses.replace(model.args, layer_window=(None,) * model.args.num_hidden_layers))
    unwindowed.load_state_dict(model.state_dict(), strict=False)
    tokens = torch.randint(0, model.args.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(tokens, torch.tensor([0])) - unwindowed(tokens, torch.tensor([0]))).abs().max().item()
    assert diff > 1e-3


def export_family(exported, family_checkpoint, family: str, quant: str, model_option: str,  # type: ignore[no-untyped-def]
                  methods: str = "[prefill,decode]") -> ExportResult:
    return exported(f"model={model_option}", f"model.checkpoint={family_checkpoint(family)}", "backend=xnnpack",
                    f"quant={quant}", f"export.methods={methods}", "export.layout=split", f"export.max_seq_len={MAX_SEQ_LEN}")


def prompt_ids(ckpt: Path) -> torch.Tensor:
    tokenizer = find_tokenizer(ckpt)
    assert tokenizer is not None
    return torch.tensor([[1, *load_tokenizer(tokenizer).encode(PROMPT)]])


def run_greedy(program: LoadedProgram, reference, tokens: torch.Tensor):  # type: ignore[no-untyped-def]
    """Prefill the prompt (token by token through the one-token method if the program has no prefill), then
    DECODE_STEPS greedy decode steps; yields (runtime, reference) logits per step."""
    driver = Driver.of(program)
    logits = driver.prefill(tokens)[0]
    for _ in range(DECODE_STEPS + 1):
        yield logits, reference(tokens)
        next_token = logits.argmax().view(1, 1)
        logits = driver.decode_one_token(next_token, tokens.shape[1])[0]
        tokens = torch.cat([tokens, next_token], dim=1)


# One method of any length does the prompt and each decode step: a family's layers are the same code in every
# method, and prefill beside decode is tested on the real SmolLM2 (tests/test_quant_backends.py); a second graph per
# family would double its lowering, the suite's largest cost.
PARITY_METHODS = "[forward]"


# Some families' fp32 programs are graphs the full run already runs: Ministral 3's is Mistral's (only its RoPE table's
# values differ, checked eagerly above) and Mistral's is Llama's with Gemma 2's and Gemma 3's sliding windows, OLMo 3's
# is OLMo 2's with Gemma 3's windows and per-type RoPE; Qwen2's q/k/v biases are OLMo 2's attention biases, Qwen3's
# per-head q/k norms Gemma 3's, Gemma's (one KV head, 1 + w norms, tied) Gemma 3's; the hybrids' fp32 programs run
# against transformers on the portable backend (tests/test_hybrid.py) and through XNNPACK as 8da4w programs below;
# Gemma 4's fp32 decoder (per-layer embeddings, KV sharing, windows) is its program of every modality, whose decode
# and text_decoder write transformers' greedy tokens past the window (tests/test_gemma4_audio.py). Each family is
# still checked against transformers eagerly above, with both attentions. They run with `pytest -m extended`, kept
# out of the full run for its time. Granite's fp32 decoder (Llama with four multipliers) is Granite Speech's, whose program
# runs in tests/test_audio_language.py. Llama's is SmolLM2's, whose fp32 program the full run checks against the eager
# model in the runtime (tests/test_quant_backends.py), and that eager model against transformers on the real weights
# (tests/test_real_model.py) and on the tiny checkpoint above.
FP32_PROGRAM_EXTENDED = {"ministral3", "olmo3", "lfm2", "qwen3_5", "mistral", "qwen2", "qwen3", "gemma", "gemma4",
                         "granite", "llama"}


@pytest.mark.parametrize("family", [pytest.param(f, marks=[pytest.mark.extended] if f in FP32_PROGRAM_EXTENDED else [])
                                    for f in FAMILY_NAMES])
def test_fp32_program_matches_transformers(exported, family_checkpoint, family: str) -> None:
    ckpt = family_checkpoint(family)
    result = export_family(exported, family_checkpoint, family, "fp32", model_option=family, methods=PARITY_METHODS)
    assert result.manifest.model.family == family
    ref = transformers_model(ckpt)
    tokens = prompt_ids(ckpt)
    with torch.no_grad():
        steps = list(run_greedy(LoadedProgram(result.pte_path), lambda t: ref(t).logits[0, -1], tokens))
    assert tokens.shape[1] + DECODE_STEPS > 2 * (FAMILY_CASES[family].get("sliding_window") or 0)
    runtime_tokens = [int(got.argmax()) for got, _ in steps]
    for i, (got, expected) in enumerate(steps):
        assert (got - expected).abs().max().item() <= 1e-4, f"{'prefill' if i == 0 else f'decode step {i}'}"
    assert runtime_tokens == [int(expected.argmax()) for _, expected in steps], "greedy tokens differ"
    assert len(set(runtime_tokens)) > 1, "a degenerate model would hide cache bugs"


# Quantization meets each family's own layers in qwen2 (biases on q, k, v), phi3 (fused qkv and gate_up projections) and
# the hybrids lfm2 and qwen3_5 (their recurrent layers' projections); soft-capped final logits in Gemma 4's 8da4w
# program with its assistant (tests/test_gemma4_drafter.py); llama's plain shape is the real SmolLM2's 8da4w program in
# the full run (tests/test_quant_backends.py), and the others' layers are theirs in fp32 above, so their 8da4w programs
# run with `pytest -m extended`, kept out of the full run for its time.
QUANTIZED_IN_FULL_RUN = {"qwen2", "phi3", "lfm2", "qwen3_5"}


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f in QUANTIZED_IN_FULL_RUN else [pytest.mark.extended])
                                    for f in FAMILY_NAMES])
def test_8da4w_program_matches_the_eager_quantized_model(exported, family_checkpoint, family: str) -> None:
    """Exported through model=hf (the family comes from config.json), decode only: the quantized prefill
    path is the same code as fp32's and is covered for Llama in test_export; this keeps the suite short."""
    result = export_family(exported, family_checkpoint, family, "8da4w", model_option="hf", methods="[decode]")
    assert result.manifest.model.family == family
    assert result.manifest.quantization.linear.torchao_config == "Int8DynamicActivationIntxWeightConfig"
    if family in ("llama", "qwen3"):  # Qwen3's q/k norms stay inside the layer's partition: one per layer + lm_head
        layers = json.loads((family_checkpoint(family) / "config.json").read_text())["num_hidden_layers"]
        assert [m.delegated_partitions for m in result.manifest.methods.values()] == [layers + 1]
    eager = eager_model_of(result)

    def full_sequence(tokens: torch.Tensor) -> torch.Tensor:
        eager.reset_cache()
        return eager(tokens, torch.tensor([0]), full_logits=True)[0, -1]

    with torch.no_grad():
        steps = list(run_greedy(LoadedProgram(result.pte_path), full_sequence, prompt_ids(family_checkpoint(family))))
    for i, (got, expected) in enumerate(steps):
        assert (got - expected).abs().max() <= 0.05 * expected.abs().max(), f"step {i}"
        assert int(got.argmax()) == int(expected.argmax()), f"greedy token differs at step {i}"


def test_sentencepiece_tokenizer_is_validated_copied_and_used_for_generation(exported, family_checkpoint) -> None:
    """Gemma's test checkpoint has only tokenizer.model: export validates with it, ships it, generates with it.
    (Gemma's parity program above.)"""
    from exporters.runtime.generator import Generator, SamplingConfig

    ckpt = family_checkpoint("gemma")
    assert (ckpt / "tokenizer.model").exists() and not (ckpt / "tokenizer.json").exists()
    result = export_family(exported, family_checkpoint, "gemma", "fp32", model_option="gemma", methods=PARITY_METHODS)
    assert "tokenizer.model" in result.manifest.tokenizer_files
    assert (result.pte_path.parent / "tokenizer.model").exists()
    out = Generator(result.pte_path).generate("Once upon a time", SamplingConfig(max_new_tokens=12))
    assert out.new_ids and out.text == load_tokenizer(ckpt / "tokenizer.model").decode(out.new_ids)


def test_family_option_must_match_the_checkpoint(family_checkpoint) -> None:
    with pytest.raises(ModelError, match=r"model=qwen3 expects Qwen3ForCausalLM.*Gemma2ForCausalLM.*model=gemma2"):
        build_model(open_checkpoint(family_checkpoint("gemma2")), 32, family="qwen3")


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_random_init_builds_a_family_from_model_arch(family: str) -> None:
    from models.sources import SOURCES

    arch = ["model.arch.hidden_size=64", "model.arch.intermediate_size=128", "model.arch.num_hidden_layers=2",
            "model.arch.num_attention_heads=4", "model.arch.num_key_value_heads=2", "model.arch.vocab_size=300"]
    cfg = compose_config(f"model={family}", "model.random_init=true", *arch).model
    ckpt = SOURCES["hf"](cfg, Path("."))
    model = build_model(ckpt, 32, family=family, random_init=True)
    assert model.args.qk_norm and model.args.num_hidden_layers == 2
    assert model(torch.tensor([[1, 2, 3]]), torch.tensor([0])).shape == (1, 300)


def test_inconsistent_heads_are_a_clear_error() -> None:
    from models.sources import SOURCES

    arch = ["model.arch.hidden_size=64", "model.arch.intermediate_size=128", "model.arch.num_hidden_layers=2",
            "model.arch.num_attention_heads=4", "model.arch.num_key_value_heads=3", "model.arch.vocab_size=300"]
    ckpt = SOURCES["hf"](compose_config("model=llama", "model.random_init=true", *arch).model, Path("."))
    with pytest.raises(ModelError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        build_model(ckpt, 32, random_init=True)


def test_random_init_without_family_says_how_to_pick_one() -> None:
    from models.sources import SOURCES

    with pytest.raises(ModelError, match="cannot tell which family.*model=<family>"):
        SOURCES["hf"](compose_config("model=hf", "model.random_init=true").model, Path("."))


def test_longrope_past_its_switch_over_is_refused(family_checkpoint) -> None:
    with pytest.raises(ModelError, match=r"longrope.*original_max_position_embeddings=64.*export.max_context_len<=64"):
        build_model(open_checkpoint(family_checkpoint("phi3")), 128)


def test_ministral3_past_its_query_scale_switch_over_is_refused(family_checkpoint) -> None:
    ckpt = open_checkpoint(family_checkpoint("ministral3"))
    build_model(ckpt, 64, device="meta")  # up to original_max_position_embeddings the scale is exactly 1
    with pytest.raises(ModelError, match=r"scales its queries.*original_max_position_embeddings=64.*"
                                         r"export.max_context_len<=64"):
        build_model(ckpt, 65, device="meta")


def test_unknown_family_option_lists_the_families() -> None:
    from exporters.export import checked_config as to_typed
    from tests.helpers import compose_config

    with pytest.raises(ModelError, match=r"model.family='falcon' is not known.*gemma.*qwen3"):
        to_typed(compose_config("model=hf", "model.family=falcon"))


def test_tiny_source_writes_any_family(tmp_path: Path) -> None:
    from models.sources import SOURCES

    cfg = compose_config("model=tiny", "model.family=gemma2").model
    ckpt = SOURCES["tiny"](cfg, tmp_path)
    assert json.loads((ckpt.path / "config.json").read_text())["architectures"] == ["Gemma2ForCausalLM"]


def test_family_falls_back_to_model_type_without_architectures(tmp_path: Path, family_checkpoint) -> None:
    d = copy_checkpoint(family_checkpoint("qwen3"), tmp_path / "c", drop=("architectures",))
    assert build_model(open_checkpoint(d), 32).args.qk_norm


def test_unsupported_multimodal_architecture_is_named(tmp_path: Path, family_checkpoint) -> None:
    d = copy_checkpoint(family_checkpoint("gemma3"), tmp_path / "c",
                        config={"architectures": ["PaliGemmaForConditionalGeneration"]})
    expected = r"PaliGemmaForConditionalGeneration.*not implemented.*Gemma3ForCausalLM \(model=gemma3\)"
    with pytest.raises(ModelError, match=expected):
        build_model(open_checkpoint(d), 32)


def test_a_vision_language_architecture_without_its_text_config_is_named(tmp_path: Path, family_checkpoint) -> None:
    d = copy_checkpoint(family_checkpoint("gemma3"), tmp_path / "c",
                        config={"architectures": ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(ModelError, match=r"Gemma3ForConditionalGeneration.*no text_config"):
        build_model(open_checkpoint(d), 32)
