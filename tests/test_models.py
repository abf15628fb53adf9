"""The exportable decoder against transformers' LlamaForCausalLM, and checkpoint loading errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.checkpoint import build_model, open_checkpoint
from models.errors import ModelError
from models.tiny import write_tiny_checkpoint
from tests.helpers import assert_matches_transformers, copy_checkpoint

VARIANTS = {
    "tiny-default (GQA 2:1, tied)": {},
    "untied, MHA": {"tie_word_embeddings": False, "num_key_value_heads": 4},
    "GQA 4:1, head_dim != hidden/heads, odd vocab": {
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 12, "vocab_size": 389,
    },
    "llama3 rope scaling, bias": {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        "attention_bias": True, "mlp_bias": True,
    },
}


def reference_and_ours(ckpt_dir: Path, max_context: int = 64, attention: str = "aten"):  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(str(ckpt_dir), torch_dtype=torch.float32).eval()
    ours = build_model(open_checkpoint(ckpt_dir), max_context, attention=attention)
    return ref, ours


@pytest.mark.parametrize("attention", ["aten", "custom_ops"])
@pytest.mark.parametrize("arch", VARIANTS.values(), ids=list(VARIANTS))
def test_logits_match_transformers_prefill_and_decode(tmp_path: Path, arch: dict, attention: str) -> None:
    ref, ours = reference_and_ours(write_tiny_checkpoint(tmp_path, arch=arch, seed=3), attention=attention)
    vocab = ours.args.vocab_size
    tokens = torch.randint(0, vocab, (1, 20), generator=torch.Generator().manual_seed(0))
    assert_matches_transformers(ref, ours, tokens, prefill_len=12)


def test_llama3_rope_scaling_is_actually_applied(tmp_path: Path) -> None:
    """Guard against silently falling back to plain RoPE: scaled and unscaled frequencies differ."""
    plain = build_model(open_checkpoint(write_tiny_checkpoint(tmp_path / "a")), 32)
    scaled = build_model(open_checkpoint(write_tiny_checkpoint(tmp_path / "b", arch=VARIANTS["llama3 rope scaling, bias"])), 32)
    assert not torch.allclose(torch.tensor(plain.args.rope[0][1].inv_freq), torch.tensor(scaled.args.rope[0][1].inv_freq))


def test_sharded_checkpoint_loads_identically(tmp_path: Path, tiny_checkpoint: Path) -> None:
    from transformers import LlamaForCausalLM

    sharded = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(str(tiny_checkpoint)).save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a = build_model(open_checkpoint(tiny_checkpoint), 32)
    b = build_model(open_checkpoint(sharded), 32)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_tied_embeddings_share_one_tensor_and_nothing_stays_on_meta(tiny_checkpoint: Path) -> None:
    model = build_model(open_checkpoint(tiny_checkpoint), 32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])


def test_bos_eos_and_tokenizer_come_from_the_checkpoint(tiny_checkpoint: Path) -> None:
    ckpt = open_checkpoint(tiny_checkpoint)
    assert ckpt.bos_id == 1 and ckpt.eos_ids == [2]
    assert "tokenizer.json" in [f.name for f in ckpt.tokenizer_files]


def test_several_eos_ids_are_kept(tmp_path: Path, tiny_checkpoint: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    copy_checkpoint(tiny_checkpoint, ckpt_dir)
    gen = json.loads((ckpt_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 0]
    (ckpt_dir / "generation_config.json").write_text(json.dumps(gen))
    assert open_checkpoint(ckpt_dir).eos_ids == [2, 0]


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist.*model.checkpoint="):
        open_checkpoint(tmp_path / "nowhere")


def test_missing_config(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    (d / "config.json").unlink()
    with pytest.raises(ModelError, match="config.json is missing"):
        open_checkpoint(d)


def test_no_weights_and_pickle_only(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(ModelError, match="pickle checkpoints are not read"):
        open_checkpoint(d)


def test_truncated_weights_name_the_file(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match=r"model\.safetensors: damaged or truncated"):
        build_model(open_checkpoint(d), 32)


def test_missing_shard_is_named(tmp_path: Path, tiny_checkpoint: Path) -> None:
    from transformers import LlamaForCausalLM

    d = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(str(tiny_checkpoint)).save_pretrained(d, max_shard_size="40KB")
    victim = sorted(d.glob("*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(ModelError, match=victim.name):
        open_checkpoint(d)


def test_weights_of_another_shape_name_the_tensor(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c", config={"intermediate_size": 96})
    with pytest.raises(ModelError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):
        build_model(open_checkpoint(d), 32)


def test_unsupported_architecture_lists_supported_ones(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c", config={"architectures": ["GPTNeoXForCausalLM"]})
    expected = r"GPTNeoXForCausalLM.*not implemented.*LlamaForCausalLM \(model=llama\).*Qwen3ForCausalLM"
    with pytest.raises(ModelError, match=expected):
        build_model(open_checkpoint(d), 32)


def test_rope_theta_override_reaches_the_rope_table(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """model.arch.rope_theta on a checkpoint with its own config.json: applied, not silently dropped."""
    from models.families import rope_table
    from models.sources import SOURCES
    from tests.helpers import compose_config

    base = SOURCES["hf"](compose_config("model=llama", f"model.checkpoint={tiny_checkpoint}").model, tmp_path)
    cfg = compose_config("model=llama", f"model.checkpoint={tiny_checkpoint}", "model.arch.rope_theta=12345")
    ckpt = SOURCES["hf"](cfg.model, tmp_path)
    head_dim = ckpt.hf_config.hidden_size // ckpt.hf_config.num_attention_heads
    assert rope_table(ckpt.hf_config).inv_freq[1] == pytest.approx(12345 ** (-2 / head_dim))
    assert rope_table(base.hf_config).inv_freq[1] != pytest.approx(12345 ** (-2 / head_dim))


def test_rope_theta_override_of_per_layer_rope_is_refused(family_checkpoint, tmp_path: Path) -> None:
    from models.sources import SOURCES
    from tests.helpers import compose_config

    cfg = compose_config("model=gemma3", f"model.checkpoint={family_checkpoint('gemma3')}", "model.arch.rope_theta=1e5")
    with pytest.raises(ModelError, match="one RoPE table per layer type"):
        SOURCES["hf"](cfg.model, tmp_path)
