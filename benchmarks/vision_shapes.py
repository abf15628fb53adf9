"""Published vision-language shapes as ``config.json`` folders, for measuring real sizes with random weights.

    python -m benchmarks.vision_shapes smolvlm-256m --out /tmp/smolvlm-256m
    python -m exporters.llm model=hf model.checkpoint=/tmp/smolvlm-256m model.random_init=true quant=8da4w \
        export.max_seq_len=128

No vision-language weights ship in a package we found; these are the shapes of the published checkpoints (their
``config.json`` values), built with transformers' own config classes, so ``model.random_init=true`` exports a
program of the real size (docs/vision.md). Change a shape only with a new name: the numbers in docs refer to these.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable


def smolvlm_256m() -> Any:
    """SmolVLM-256M-Instruct: SigLIP 768 wide x 12 layers at 512 px (patches of 16, pixel shuffle 4: 64 positions),
    a SmolLM2-135M-shaped decoder."""
    from transformers import Idefics3Config, Idefics3VisionConfig, LlamaConfig

    return Idefics3Config(
        vision_config=Idefics3VisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                           num_attention_heads=12, image_size=512, patch_size=16),
        text_config=LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                num_key_value_heads=3, vocab_size=49280, rope_theta=100000.0,
                                max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                bos_token_id=1, eos_token_id=2),
        scale_factor=4, image_token_id=49190, tie_word_embeddings=True,
        architectures=["Idefics3ForConditionalGeneration"])


def gemma3_4b() -> Any:
    """Gemma 3 4B: SigLIP so400m (1152 wide x 27 layers at 896 px, pooled to 256 positions), a 34-layer decoder
    2560 wide with 262k tokens, 5 sliding-window layers per global one."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024,
                            query_pre_attn_scalar=256, rope_scaling={"rope_type": "linear", "factor": 8.0},
                            rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=131072,
                            bos_token_id=2, eos_token_id=1)
    return Gemma3Config(
        text_config=text,
        vision_config=SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                         num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=256, image_token_index=262144, boi_token_index=255999, eoi_token_index=256000,
        architectures=["Gemma3ForConditionalGeneration"])


def _lfm2_vl(text: str, width: int, ffn: int, layers: int, heads: int) -> Any:
    """LFM2-VL: SigLIP2 NaFlex (patches of 16, a 16 x 16 position grid) pixel-unshuffled by 2 into a two-layer
    projector 2048 wide (no norm), beside an LFM2 decoder of ``benchmarks.presets``. The values are the published
    config.json's, as a public loader pins them against the hub's tensor headers."""
    from transformers import Lfm2VlConfig, Siglip2VisionConfig

    from benchmarks.presets import PRESETS

    decoder = PRESETS[text].hf_config()
    decoder.architectures = None
    return Lfm2VlConfig(
        text_config=decoder,
        vision_config=Siglip2VisionConfig(hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers,
                                          num_attention_heads=heads, patch_size=16, num_patches=256,
                                          vision_use_head=False),
        downsample_factor=2, projector_hidden_size=2048, projector_use_layernorm=False, image_token_id=396,
        tie_word_embeddings=True, architectures=["Lfm2VlForConditionalGeneration"])


def lfm2_vl_450m() -> Any:
    """LFM2-VL-450M: SigLIP2 NaFlex base (768 wide x 12 layers), LFM2-350M's decoder. Without processor files the
    program takes LFM2-VL's default budget of 256 positions: 512 x 512 images."""
    return _lfm2_vl("lfm2-350m", 768, 3072, 12, 12)


def lfm2_vl_1_6b() -> Any:
    """LFM2-VL-1.6B: SigLIP2 NaFlex so400m (1152 wide x 27 layers), LFM2-1.2B's decoder."""
    return _lfm2_vl("lfm2-1.2b", 1152, 4304, 27, 16)


QWEN_VL_TOKENS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                  "vision_end_token_id": 151653}


def qwen3_vl_2b() -> Any:
    """Qwen3-VL-2B-Instruct: a ViT 1024 wide x 24 layers (patches of 16, a learned 48 x 48 position table, deepstack
    from layers 5, 11, 17), a Qwen3 decoder 2048 wide x 28 layers with interleaved M-RoPE. The values are the
    published config.json's (as ExecuTorch's Arm test pins them: backends/arm/test/models/Qwen3_VL). Without processor
    files the program takes 448 x 448 images: 196 positions."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config={"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
                     "max_position_embeddings": 262144, "tie_word_embeddings": True, "bos_token_id": 151643,
                     "eos_token_id": 151645,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000, "mrope_section": [24, 20, 20],
                                         "mrope_interleaved": True}},
        vision_config={"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                       "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "num_position_embeddings": 2304, "deepstack_visual_indexes": [5, 11, 17],
                       "hidden_act": "gelu_pytorch_tanh"},
        tie_word_embeddings=True, architectures=["Qwen3VLForConditionalGeneration"], **QWEN_VL_TOKENS)


def qwen2_5_vl_3b() -> Any:
    """Qwen2.5-VL-3B-Instruct: a ViT 1280 wide x 32 layers (patches of 14, windows of 112 px but in layers 7, 15,
    23, 31), a Qwen2 decoder 2048 wide x 36 layers with M-RoPE sections. Without processor files the program takes
    448 x 448 images: 256 positions."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config={"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                     "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6,
                     "max_position_embeddings": 128000, "tie_word_embeddings": True, "bos_token_id": 151643,
                     "eos_token_id": 151645,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}},
        vision_config={"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                       "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu"},
        tie_word_embeddings=True, architectures=["Qwen2_5_VLForConditionalGeneration"], **QWEN_VL_TOKENS)


def gemma4_e2b() -> Any:
    """Gemma 4 E2B: a 35-layer decoder 1536 wide (four sliding-window layers of 512 per global one; the last 20 read
    an earlier layer's KV cache, with MLPs twice as wide), 262k tokens with a per-layer embedding table of 256 per
    layer (2.35B of its 4.80B parameters without an audio tower), and a vision tower 768 wide x 16 layers (patches
    of 16, pooled 3 x 3: 768 px images, 256 positions). The decoder's values are ExecuTorch's Gemma 4 example's E2B
    config (examples/models/gemma4/text_decoder/gemma4_config.py); the tower's transformers' Gemma4VisionConfig defaults
    (its docstring: similar to gemma-4-e2b-it)."""
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    text = Gemma4TextConfig(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                            num_key_value_heads=1, head_dim=256, global_head_dim=512, vocab_size=262144,
                            hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
                            num_kv_shared_layers=20, use_double_wide_mlp=True, sliding_window=512,
                            final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                            layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
                            bos_token_id=2, eos_token_id=1)
    return Gemma4Config(text_config=text, vision_config=Gemma4VisionConfig(), tie_word_embeddings=True,
                        architectures=["Gemma4ForConditionalGeneration"])


SHAPES: dict[str, Callable[[], Any]] = {"smolvlm-256m": smolvlm_256m, "gemma3-4b": gemma3_4b,
                                        "lfm2-vl-450m": lfm2_vl_450m, "lfm2-vl-1.6b": lfm2_vl_1_6b,
                                        "qwen3-vl-2b": qwen3_vl_2b, "qwen2.5-vl-3b": qwen2_5_vl_3b,
                                        "gemma4-e2b": gemma4_e2b}


def write_shape(name: str, out: Path) -> Path:
    SHAPES[name]().save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, required=True, help="the folder to write config.json into")
    args = parser.parse_args()
    folder = write_shape(args.shape, args.out)
    print(f"model=hf model.checkpoint={folder} model.random_init=true")


if __name__ == "__main__":
    main()
