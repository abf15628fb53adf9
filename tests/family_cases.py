"""One tiny transformers config per model family, each varying a shape that breaks implementations.

Every config keeps in_features a multiple of 32 so the same checkpoint also takes 8da4w (group 32).
Sliding windows are shorter than the test sequences, so the window really masks something.
"""

from __future__ import annotations

from typing import Any

FAMILY_CASES: dict[str, dict[str, Any]] = {
    # GQA 4:1, head_dim 32 != 64/4, odd vocab, untied, llama3 rope scaling.
    "llama": {
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 389,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    },
    # Granite's four multipliers, none of them 1 (the embedding's and the logits' far from it), attention biases,
    # tied.
    "granite": {
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 389, "tie_word_embeddings": True,
        "attention_bias": True, "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
        "residual_multiplier": 0.22, "logits_scaling": 8.0,
    },
    # A sliding window of 6 on every layer, head_dim 24 (o_proj in 96), untied.
    "mistral": {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 397,
        "tie_word_embeddings": False, "sliding_window": 6,
    },
    # q/k/v biases, tied, layers from max_window_layers=1 on slide.
    "qwen2": {
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 391,
        "tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1,
    },
    # q/k norms, GQA 4:1 with head_dim 8 (8 heads), tied, odd vocab.
    "qwen3": {
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 403,
        "tie_word_embeddings": True,
    },
    # Fused qkv / gate_up, partial rotary 0.75, longrope with its attention factor, untied.
    "phi3": {
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 389, "tie_word_embeddings": False,
        "max_position_embeddings": 256, "original_max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0],
                            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]},
    },
    # Multi-query attention (1 kv head), head_dim 32 != 64/4, tied (as Gemma ships).
    "gemma": {
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 397,
        "tie_word_embeddings": True,
    },
    # Soft-capped attention and logits, query_pre_attn_scalar != head_dim, alternating windows of 5.
    "gemma2": {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 401,
        "tie_word_embeddings": True, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 20.0,
        "final_logit_softcapping": 10.0, "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # q/k norms, local (sliding, theta 1e4) and global (linear-scaled, theta 1e6) RoPE.
    "gemma3": {
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
        "vocab_size": 393, "tie_word_embeddings": True, "query_pre_attn_scalar": 48, "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    },
    # Six layers, the last two reading layers 2's and 3's caches (KV sharing) with double-wide MLPs; head size 16 with
    # 1 kv head on sliding layers (window 6), 32 with 2 on full ones, whose values are their keys (attention_k_eq_v)
    # and whose RoPE is "proportional" (a quarter of the pairs rotate); per-layer embeddings of 32; final soft-capping.
    "gemma4": {
        "num_hidden_layers": 6, "layer_types": ["sliding_attention", "full_attention"] * 3,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 32,
        "num_global_key_value_heads": 2, "attention_k_eq_v": True, "vocab_size": 397, "tie_word_embeddings": True,
        "sliding_window": 6, "hidden_size_per_layer_input": 32, "vocab_size_per_layer_input": 397,
        "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "final_logit_softcapping": 10.0,
    },
    # NoPE every second layer, tied.
    "smollm3": {
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 389, "tie_word_embeddings": True,
        "no_rope_layer_interval": 2,
    },
    # Yarn RoPE (factor 4 over 64 original positions) with Llama 4's query scale, which is 1 below those 64 positions;
    # a sliding window of 7 on every layer, untied.
    "ministral3": {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 397,
        "tie_word_embeddings": False, "sliding_window": 7, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                            "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1},
    },
    # Post norms only (no norm before attention or MLP), q and k normed across all heads at once, attention biases.
    "olmo2": {
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 389, "tie_word_embeddings": False,
        "attention_bias": True,
    },
    # OLMo 2's layers with sliding windows of 5 on every other layer, each layer type its own RoPE (linear-scaled on
    # full attention), tied.
    "olmo3": {
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 397, "tie_word_embeddings": True,
        "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}},
    },
    # Hybrid: short convolutions (3 taps, with biases) around an attention layer, q/k norms, the feed-forward width
    # derived (2/3 of 144, rounded up to 32: 96), tied.
    "lfm2": {
        "num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 389, "tie_word_embeddings": True, "intermediate_size": 144,
        "block_multiple_of": 32, "conv_bias": True, "norm_eps": 1e-5,
    },
    # Hybrid: Gated DeltaNet layers (2 key heads serving 4 value heads, key dim 16 != value dim 8, 4 taps) around a gated
    # attention layer with partial RoPE (half the head) and M-RoPE sections, norms scaling by 1 + w, tied.
    "qwen3_5": {
        "num_hidden_layers": 4, "layer_types": ["linear_attention", "linear_attention", "full_attention",
                                                "linear_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 389,
        "tie_word_embeddings": True, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    },
}

# Families with layers whose state is not a KV cache (tests/test_hybrid.py).
HYBRID = ("lfm2", "qwen3_5")

# Families whose test checkpoint ships a SentencePiece tokenizer.model instead of tokenizer.json.
SENTENCEPIECE = {"gemma"}

COMMON = {"hidden_size": 64, "intermediate_size": 128}


def family_arch(family: str) -> dict[str, Any]:
    return {**COMMON, **FAMILY_CASES[family]}
