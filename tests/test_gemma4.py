"""Gemma 4's text decoder (issue 64): what it has that Gemma 3 does not, beyond the families' parity tests
(tests/test_families.py runs its checkpoint against transformers eagerly with both attentions, and its fp32 program
step by step): layers that read an earlier layer's cache keep none of their own, published checkpoints' unused
tensors are skipped, and what is not implemented for it is refused before any weight is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exporters.errors import UserError
from exporters.export import export
from models.checkpoint import build_model, open_checkpoint
from models.errors import ModelError
from tests.family_cases import FAMILY_CASES
from tests.helpers import compose_config, copy_checkpoint
from tests.test_families import MAX_SEQ_LEN

CASE = FAMILY_CASES["gemma4"]
LAYERS = CASE["num_hidden_layers"]
SHARED = range(LAYERS - CASE["num_kv_shared_layers"], LAYERS)  # the layers reading an earlier layer's cache


def test_layers_that_share_a_cache_keep_none_and_read_the_last_layer_of_their_type(family_checkpoint) -> None:
    model = build_model(open_checkpoint(family_checkpoint("gemma4")), MAX_SEQ_LEN)
    a = model.args
    # Layers 4 (sliding) and 5 (full) read layers 2 and 3: the last of each type that keeps a cache.
    assert a.layer_kv_source == (None, None, None, None, 2, 3)
    assert [a.layer_window[i] for i in (2, 4)] == [CASE["sliding_window"]] * 2 and a.layer_window[3] is None
    assert a.layer_head_dim == (16, 32) * 3 and a.layer_kv_heads == (1, 2) * 3
    assert a.layer_intermediate == (128,) * 4 + (256,) * 2  # double-wide MLPs on the sharing layers
    for i in SHARED:
        attn = model.model.layers[i].self_attn
        assert not hasattr(attn, "k_proj") and not hasattr(attn, "kv_cache")
        assert attn.cache() is model.model.layers[a.layer_kv_source[i]].self_attn.kv_cache
    assert not hasattr(model.model.layers[3].self_attn, "v_proj")  # full layers' values are their keys (k_eq_v)
    # The state methods share is the four owners' caches, once each.
    assert {name.split(".")[2] for name in model.state_buffers()} == {"0", "1", "2", "3"}
    assert len(model.kv_caches()) == 4


def test_the_manifest_records_four_caches_for_six_layers(family_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """What a program's manifest says of its cache (``kv_cache_entry``, read from the model the program is captured
    from, as the decoder's manifest entry does): which layers read which cache, and the four owners' bytes. The
    model's fp32 program runs against transformers in tests/test_families.py (extended) and, with its towers, in
    tests/test_gemma4_audio.py."""
    from exporters.program.cache import kv_cache_entry

    kv = kv_cache_entry(build_model(open_checkpoint(family_checkpoint("gemma4")), MAX_SEQ_LEN), MAX_SEQ_LEN)
    assert kv.cache_of == [None, None, None, None, 2, 3] and len(kv.slots) == 4
    # Keys and values of 1 head of 16 (sliding) and 2 heads of 32 (full), fp32, in layers 0-3 only.
    assert kv.bytes_per_token == 2 * 4 * (1 * 16 + 2 * 32 + 1 * 16 + 2 * 32)
    assert "2 of 6 layers read an earlier layer's cache" in kv.describe()


def test_the_decoder_of_a_published_multimodal_checkpoint_exports_alone(tmp_path: Path) -> None:
    """Gemma 4 ships as Gemma4ForConditionalGeneration (towers beside the decoder, `model.language_model.` names), its
    files carrying k/v projections and norms for the sharing layers, which transformers skips on load. The decoder
    loads from them (towers and those tensors skipped) and computes transformers' logits for a text prompt."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig

    from tests.family_cases import family_arch

    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    reference = Gemma4ForConditionalGeneration(Gemma4Config(text_config=Gemma4TextConfig(**family_arch("gemma4")),
                                                            vision_config=vision)).eval()
    ckpt = tmp_path / "published"
    reference.save_pretrained(ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    for i in SHARED:  # shaped as the layer's own would be
        d, kv = (16, 1) if i % 2 == 0 else (32, 2)
        for name, shape in (("k_proj.weight", (kv * d, 64)), ("v_proj.weight", (kv * d, 64)), ("k_norm.weight", (d,))):
            tensors[f"model.language_model.layers.{i}.self_attn.{name}"] = torch.randn(shape)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    ours = build_model(open_checkpoint(ckpt), MAX_SEQ_LEN)
    assert ours.args.layer_kv_source == (None, None, None, None, 2, 3)
    tokens = torch.randint(3, 390, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens, torch.tensor([0]), full_logits=True),
                                   reference(input_ids=tokens).logits, atol=1e-4, rtol=0)


def test_mixture_of_experts_layers_are_refused(family_checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(family_checkpoint("gemma4"), tmp_path / "moe", config={"enable_moe_block": True})
    with pytest.raises(ModelError, match=r"mixture-of-experts layers \(enable_moe_block\).*dense models"):
        build_model(open_checkpoint(ckpt), MAX_SEQ_LEN)


def test_bidirectional_attention_within_images_keeps_text_causal(family_checkpoint, tmp_path: Path) -> None:
    """use_bidirectional_attention="vision" (the larger Gemma 4 configs) attends both ways only within an image's tokens:
    the text decoder is transformers' causal one and exports; "all" is not a causal LM and is refused."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import assert_matches_transformers

    ckpt = copy_checkpoint(family_checkpoint("gemma4"), tmp_path / "vision",
                           config={"use_bidirectional_attention": "vision"})
    ref = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ours = build_model(open_checkpoint(ckpt), MAX_SEQ_LEN)
    tokens = torch.randint(3, 380, (1, 10), generator=torch.Generator().manual_seed(1))
    assert_matches_transformers(ref, ours, tokens, prefill_len=6)
    every = copy_checkpoint(family_checkpoint("gemma4"), tmp_path / "all", config={"use_bidirectional_attention": "all"})
    with pytest.raises(ModelError, match="bidirectional attention everywhere"):
        build_model(open_checkpoint(every), MAX_SEQ_LEN)


@pytest.mark.parametrize("overrides,says", [
    (["quant=8da4w_calibrated"], r"quant.algorithm=gptq run the decoder one layer at a time.*KV sharing.*hqq"),
    (["quant=8da4w", "quant.size_budget=1.05"], r"quant.size_budget run the decoder one layer at a time"),
    (["quant=8da4w_rotated"], r"quant.rotation and quant.online_hadamard rotate every layer alike.*quant.rotation=none"),
])
def test_what_is_not_implemented_for_it_is_refused_before_any_weight_is_read(family_checkpoint, tmp_path: Path,
                                                                             overrides: list[str], says: str) -> None:
    cfg = compose_config("model=gemma4", f"model.checkpoint={family_checkpoint('gemma4')}", *overrides)
    with pytest.raises(UserError, match=says):
        export(cfg, tmp_path / "run")
    assert not list((tmp_path / "run").glob("*.pte"))


def test_the_tiny_source_writes_a_tiny_gemma4(tmp_path: Path) -> None:
    """model=tiny model.family=gemma4: transformers' defaults are E2B's (heads of 256 and 512, a per-layer table of
    262144 rows, 135M parameters at hidden 64); the tiny model is tiny, and the table covers its vocabulary."""
    import json

    from models.sources import SOURCES

    ckpt = SOURCES["tiny"](compose_config("model=tiny", "model.family=gemma4").model, tmp_path)
    config = json.loads((ckpt.path / "config.json").read_text())
    assert config["vocab_size_per_layer_input"] == config["vocab_size"] and config["hidden_size_per_layer_input"] == 16
    assert build_model(ckpt, MAX_SEQ_LEN).parameter_count() < 300_000


def test_a_bf16_model_computes_in_bf16_as_transformers_does(family_checkpoint, tmp_path: Path) -> None:
    """quant=bf16: the stored layer scalars are applied in the activation dtype (transformers stores them in the
    model's), so the hidden states stay bf16 through every layer; the logits are transformers' bf16 model's within
    bf16 rounding."""
    from transformers import AutoModelForCausalLM

    from exporters.export import run_stages

    ckpt = family_checkpoint("gemma4")
    eager, _ = run_stages(compose_config("model=gemma4", f"model.checkpoint={ckpt}", "quant=bf16",
                                         f"export.max_seq_len={MAX_SEQ_LEN}", "validate=false"),
                          tmp_path / "run", stop_after="quantize")
    tokens = torch.randint(3, 380, (1, 8), generator=torch.Generator().manual_seed(2))
    ref = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ours = eager.model(tokens, torch.tensor([0]), full_logits=True)
        assert ours.dtype == torch.bfloat16
        # logits up to about 8 (soft-capped at 10), bf16's step there 0.0625: 0.06 apart here
        torch.testing.assert_close(ours.float(), ref(input_ids=tokens).logits.float(), atol=0.15, rtol=0)
