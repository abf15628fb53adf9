"""Hybrid models (LFM2, Qwen3.5): recurrent states beside the KV cache, shared by every method, through the runtime.

Parity with transformers (eager with both attentions, the XNNPACK program in fp32 and 8da4w) is in
tests/test_families.py, as for every family; here is what is particular to a state that is not a cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exporters.errors import UserError
from exporters.export import export
from exporters.components.resolve import plan_export
from exporters.runtime.driver import Driver
from exporters.runtime.programs import LoadedProgram
from models.checkpoint import build_model, open_checkpoint
from models.errors import ModelError
from tests.family_cases import HYBRID
from tests.helpers import compose_config, copy_checkpoint
from tests.test_families import prompt_ids, transformers_model

# The portable programs' tests: Qwen3.5's with `pytest -m extended`, for the full run's time (its portable export is
# the slowest tiny export, about 90 s). LFM2's runs the same machinery (state buffers shared by the methods, zeroed at
# position 0, the stock runner); Qwen3.5's gated-delta layers run in XNNPACK against the eager model in
# tests/test_families.py and eagerly in calls here.
PORTABLE = [pytest.param(f, marks=[pytest.mark.extended] if f == "qwen3_5" else []) for f in HYBRID]

MAX_SEQ_LEN = 48


@pytest.fixture(scope="module")
def portable_program(exported, family_checkpoint):  # type: ignore[no-untyped-def]
    """A hybrid family on the portable backend (every op a portable kernel): prefill and decode sharing the state."""
    def get(family: str):  # type: ignore[no-untyped-def]
        return exported(f"model={family}", f"model.checkpoint={family_checkpoint(family)}", "backend=portable",
                        "quant=fp32", f"export.max_seq_len={MAX_SEQ_LEN}")  # stock layout: prefill, decode, forward

    return get


def test_the_manifest_and_console_give_the_state_beside_the_cache(portable_program) -> None:
    kv = portable_program("lfm2").manifest.kv_cache
    assert kv.layers == ["short_conv", "attention", "short_conv"]
    hidden, taps = 64, 3  # tests/family_cases.py: two convolutions keep their last 2 inputs of 64 fp32 features
    assert kv.state_bytes == 2 * hidden * (taps - 1) * 4
    assert kv.bytes_per_token == 2 * 2 * 16 * 4  # keys and values of the one attention layer: 2 heads of 16
    assert "1.0 KB of recurrent state in 2 of 3 layers (short_conv), the same at any length" in kv.describe()


def test_gated_delta_state_is_the_convolution_and_a_matrix_per_value_head(family_checkpoint) -> None:
    model = build_model(open_checkpoint(family_checkpoint("qwen3_5")), MAX_SEQ_LEN, device="meta")
    # tests/family_cases.py: 3 layers; channels 2 * 2 * 16 + 4 * 8 = 96 with 3 inputs kept; 4 value heads of 16 x 8.
    assert model.recurrent_state_bytes() == 3 * (96 * 3 + 4 * 16 * 8) * 4
    assert [n for n in model.state_buffers() if n.startswith("model.layers.0.")] == [
        "model.layers.0.linear_attn.conv_state", "model.layers.0.linear_attn.recurrent_state"]


@pytest.mark.parametrize("family", PORTABLE)
def test_the_methods_share_the_state_and_a_new_sequence_starts_from_zeros(portable_program, family_checkpoint,
                                                                          family: str) -> None:
    """The portable program against transformers: a prompt through prefill, decode steps continuing its state; then
    another prompt at position 0 in the same loaded program gives what it gives alone (nothing of the first sequence's
    state is left: the methods zero it at position 0, no reset method is needed)."""
    ckpt = family_checkpoint(family)
    ref = transformers_model(ckpt)
    driver = Driver.of(LoadedProgram(portable_program(family).pte_path))
    first = prompt_ids(ckpt)
    second = first[:, [0, *range(first.shape[1] - 1, 0, -1)]]  # the same tokens after BOS, reversed
    for tokens in (first, second, first):
        logits = driver.prefill(tokens)[0]
        for step in range(4):
            with torch.no_grad():
                expected = ref(tokens).logits[0, -1]
            assert (logits - expected).abs().max().item() <= 1e-4, f"step {step}"
            next_token = logits.argmax().view(1, 1)
            logits = driver.decode_one_token(next_token, tokens.shape[1])[0]
            tokens = torch.cat([tokens, next_token], dim=1)


@pytest.mark.parametrize("family", PORTABLE)
def test_the_stock_text_runner_writes_transformers_greedy_text(portable_program, family_checkpoint,
                                                              family: str) -> None:
    """ExecuTorch's own TextLLMRunner (the installed release), which knows nothing of the state, writes the text of
    transformers' greedy tokens: its prompt through forward, each token after through forward too."""
    from tokenizers import Tokenizer

    from tests.runtimes import stock_runner
    from tests.test_stock_runners import printed_tokens

    result = portable_program(family)
    assert {"prefill", "decode_one_token", "forward"} <= set(result.manifest.methods)
    tokenizer = Tokenizer.from_file(str(result.pte_path.parent / "tokenizer.json"))
    prompt = "The model was exported with ExecuTorch"
    ids = tokenizer.encode(prompt).ids
    with torch.no_grad():
        out = transformers_model(family_checkpoint(family)).generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = out[0, len(ids):].tolist()
    run = stock_runner(result.manifest.versions["executorch"], result.pte_path, prompt, 8)
    assert run["text"] == tokenizer.decode(expected[:printed_tokens(run)])


def test_gptq_quantizes_every_linear_of_the_recurrent_layers(family_checkpoint) -> None:
    """quant=8da4w_calibrated on LFM2 and Qwen3.5: GPTQ calibrates layer by layer through the recurrent layers too, and
    every linear they have is quantized (the depthwise convolutions stay float)."""
    from exporters.config import QuantConfig
    from exporters.quant.apply import quantize_model
    from exporters.quant.calibration import calibration_text
    from omegaconf import OmegaConf

    for family, linears in (("lfm2", ("conv.in_proj", "conv.out_proj")),
                            ("qwen3_5", ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                                         "linear_attn.in_proj_a", "linear_attn.out_proj"))):
        ckpt = open_checkpoint(family_checkpoint(family))
        model = build_model(ckpt, MAX_SEQ_LEN)
        cfg = compose_config(f"model={family}", "quant=8da4w_calibrated").quant
        quant = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConfig), cfg))
        record = quantize_model(model, quant, calibration=lambda: calibration_text(
            quant.calibration, None, ckpt, model.args.vocab_size, MAX_SEQ_LEN))
        layers = record.linear.layers
        assert record.linear.algorithm == "gptq", family
        assert all(f"model.layers.0.{name}" in layers for name in linears), (family, sorted(layers))


@pytest.mark.parametrize("family", HYBRID)
def test_prompts_in_several_calls_carry_the_state(family_checkpoint, family: str) -> None:
    """Eager, a prompt cut into calls of 1, 2 and 5 tokens gives the logits of one call: the state each call leaves
    goes on to the next, as the runtime's chunked prefill needs."""
    model = build_model(open_checkpoint(family_checkpoint(family)), MAX_SEQ_LEN)
    tokens = torch.randint(0, model.args.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(tokens, torch.tensor([0]), full_logits=True)
        for size in (1, 2, 5):
            model.reset_cache()
            parts = [model(tokens[:, i:i + size], torch.tensor([i]), full_logits=True) for i in range(0, 16, size)]
            torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides, named", [
    (["export.methods=[prefill,decode,verify,forward]"], r"speculative decoding.*cannot be rolled back by position"),
    (["backend=coreml", "export.layout=split"], r"backend=coreml \(static shapes\).*backend=xnnpack"),
    (["quant=8da4w_rotated"], r"quant.rotation.*quant=8da4w_calibrated"),
    (["quant=pt2e_xnnpack_dynamic"], r"quant.pt2e=xnnpack_dynamic.*torchao scheme"),
])
def test_what_a_hybrid_model_cannot_do_is_refused_before_any_weight_is_read(tmp_path: Path, family_checkpoint,
                                                                             overrides: list[str], named: str) -> None:
    cfg = compose_config("model=lfm2", f"model.checkpoint={family_checkpoint('lfm2')}", *overrides)
    out = tmp_path / "run"
    with pytest.raises(UserError, match=r"this model \(2 short_conv \+ 1 attention layers\) cannot be exported with "
                       + named):
        export(plan_export(cfg), out)
    assert not list(out.glob("*.pte")), "nothing is written"


def test_a_hybrid_checkpoint_that_does_not_fit_is_named(tmp_path: Path, family_checkpoint) -> None:
    ckpt = family_checkpoint("lfm2")
    odd = copy_checkpoint(ckpt, tmp_path / "odd", config={"layer_types": ["conv", "sliding_attention", "full_attention"]})
    with pytest.raises(ModelError, match=r"layer_types names \[.sliding_attention.\], which LFM2 does not have. Allowed: "):
        build_model(open_checkpoint(odd), MAX_SEQ_LEN, device="meta")
    heads = copy_checkpoint(family_checkpoint("qwen3_5"), tmp_path / "heads", config={"linear_num_value_heads": 3})
    with pytest.raises(ModelError, match=r"linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"):
        build_model(open_checkpoint(heads), MAX_SEQ_LEN, device="meta")
    from safetensors.torch import load_file, save_file

    missing = copy_checkpoint(ckpt, tmp_path / "missing")
    weights = load_file(missing / "model.safetensors")
    del weights["model.layers.2.conv.conv.weight"]
    save_file(weights, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"model\.layers\.2\.conv\.conv\.weight"):
        build_model(open_checkpoint(missing), MAX_SEQ_LEN)


def test_a_qwen3_5_checkpoint_as_the_hub_ships_it_exports_its_text_decoder(tmp_path: Path) -> None:
    """Every Qwen3.5 on the hub is Qwen3_5ForConditionalGeneration with a multi-token-prediction head (``mtp.*``) beside
    the text decoder: ``model=hf`` plans the decoder beside its vision encoder (docs/vision.md), the decoder loads
    without the ViT's tensors and the head and gives the whole model's logits on text."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from models.families import family_of_config
    from models.vision import text_only
    from tests.family_cases import family_arch
    from tests.helpers import assert_matches_transformers

    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 8,
              "out_hidden_size": 64, "num_position_embeddings": 16}
    config = Qwen3_5Config(text_config={**family_arch("qwen3_5"), "model_type": "qwen3_5_text"}, vision_config=vision,
                           image_token_id=385, video_token_id=386, tie_word_embeddings=True)
    torch.manual_seed(5)
    ref = Qwen3_5ForConditionalGeneration(config).eval()
    folder = tmp_path / "Qwen3.5-tiny"
    ref.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    weights["mtp.fc.weight"] = torch.randn(64, 128)  # what the hub's checkpoints add; transformers skips it
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})

    # Without processor files the image is 448 px: 784 positions of patches of 8, which one text_decoder call takes.
    cfg = compose_config("model=hf", f"model.checkpoint={folder}", "backend=portable", "quant=fp32",
                         "export.max_seq_len=800")
    assert [c.name for c in plan_export(cfg).components] == ["decoder", "vision"]
    ckpt = open_checkpoint(folder)
    assert family_of_config(ckpt.hf_config).name == "qwen3_5" and text_only(ckpt.hf_config) is None
    ours = build_model(ckpt, MAX_SEQ_LEN)
    tokens = torch.randint(0, 380, (1, 20), generator=torch.Generator().manual_seed(2))
    assert_matches_transformers(ref, ours, tokens, prefill_len=11)


def test_an_lfm2_gguf_file_exports_as_transformers_reads_it(tmp_path: Path) -> None:
    """An LFM2 ``.gguf`` (named as llama.cpp names its tensors, matrices in Q8_0, no conv biases as LFM2 ships): dequantized
    by transformers' GGUF reader into a folder, then built as any LFM2 checkpoint, matching transformers' model of it."""
    from models.gguf import gguf_checkpoint
    from models.tiny import write_tiny_checkpoint
    from tests.family_cases import family_arch
    from tests.helpers import assert_matches_transformers, write_gguf

    arch = {**family_arch("lfm2"), "conv_bias": False}
    hf = write_tiny_checkpoint(tmp_path / "hf", arch=arch, family="lfm2", seed=4, train_steps=0)
    layers, theta = arch["layer_types"], json.loads((hf / "config.json").read_text())["rope_parameters"]["rope_theta"]
    metadata = {"context_length": 128, "block_count": len(layers), "feed_forward_length": 96,
                "embedding_length": arch["hidden_size"], "rope.freq_base": theta,
                "attention.head_count": arch["num_attention_heads"],
                "attention.head_count_kv": [arch["num_key_value_heads"] if t == "full_attention" else 0 for t in layers],
                "attention.layer_norm_rms_epsilon": arch["norm_eps"], "vocab_size": arch["vocab_size"],
                "shortconv.l_cache": 3}
    gguf = write_gguf(hf, tmp_path / "LFM2-tiny.Q8_0.gguf", "lfm2", metadata)

    compose_config("model=hf", f"model.checkpoint={gguf}")  # the GGUF is a checkpoint option like any other
    folder = gguf_checkpoint(gguf, tmp_path / "converted")
    ours = build_model(open_checkpoint(folder), MAX_SEQ_LEN)
    assert ours.args.layer_mixer == build_model(open_checkpoint(hf), MAX_SEQ_LEN, device="meta").args.layer_mixer
    tokens = torch.randint(0, arch["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(3))
    assert_matches_transformers(transformers_model(folder), ours, tokens, prefill_len=9)
    original = build_model(open_checkpoint(hf), MAX_SEQ_LEN)  # Q8_0 keeps the checkpoint's logits to about 1%
    with torch.no_grad():
        a, b = (m(tokens, torch.tensor([0]), full_logits=True) for m in (original, ours))
    assert (b - a).norm() / a.norm() < 0.02, "a tensor misnamed or laid out wrong would not be this close"
