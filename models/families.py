"""Which Hugging Face model families the decoder implements, and how their configs map onto it.

One :class:`Family` per config-group option (``conf/model/<name>.yaml``): the ``architectures``
entries of ``config.json`` it accepts, the transformers ``model_type`` used to build a config from
``model.arch`` alone, and a small adapter returning the :class:`~models.decoder.DecoderArgs` fields
that differ from a plain Llama. Adding a family is one adapter here; nothing else branches on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from models.decoder import DecoderArgs, GatedDeltaShape, Mixer, Norms, RopeTable
from models.errors import ModelError
from models.multimodal import language_config, text_tensor_name


def rope_table(hf_config: Any, layer_type: str | None = None) -> RopeTable:
    """RoPE frequencies for the config's rope type, using transformers' own implementation.

    Covers ``default``, ``linear``, ``llama3``, ``yarn``, ``longrope`` ... and partial rotary: one source
    of truth, so the exported model cannot drift from the reference it is compared against.
    ``layer_type`` picks one of several tables (Gemma 3: ``sliding_attention`` / ``full_attention``).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config.standardize_rope_params()
    params = hf_config.rope_parameters or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        dim = int(dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return RopeTable(tuple(inv_freq.tolist()))
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
    return RopeTable(tuple(inv_freq.float().tolist()), float(scaling))


FamilyAdapter = Callable[[Any, int], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_type: str
    adapt: FamilyAdapter  # hf config, max context -> the DecoderArgs fields that differ from Llama's defaults
    # (pattern, replacement) on checkpoint tensor names, for a family whose modules transformers names otherwise
    # than Llama's: the decoder keeps one set of names, so quantization, GPTQ and validation read every family alike.
    renames: tuple[tuple[str, str], ...] = ()
    # Prefixes of checkpoint tensors transformers' own class skips on load (Qwen3.5's multi-token-prediction head).
    unused: tuple[str, ...] = ()
    # More such prefixes that depend on the config (Gemma 4's KV-sharing layers keep unused k/v projections).
    unused_of: Callable[[Any], tuple[str, ...]] | None = None
    # Config fields whose transformers defaults are a published model's size, at a tiny model's scale (its vocabulary
    # size -> the fields): what models.tiny writes for model=tiny model.family=<name>.
    tiny_arch: Callable[[int], dict[str, Any]] | None = None

    def tensor_name(self, name: str) -> str:
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        return name


FAMILIES: dict[str, Family] = {}


def register_family(name: str, *architectures: str, model_type: str, renames: tuple[tuple[str, str], ...] = (),
                    unused: tuple[str, ...] = (),
                    unused_of: Callable[[Any], tuple[str, ...]] | None = None,
                    tiny_arch: Callable[[int], dict[str, Any]] | None = None) -> Callable[[FamilyAdapter], FamilyAdapter]:
    def wrap(fn: FamilyAdapter) -> FamilyAdapter:
        FAMILIES[name] = Family(name, architectures, model_type, fn, renames, unused, unused_of, tiny_arch)
        return fn

    return wrap


def check_family(name: str | None) -> None:
    """``model.family`` names a registered family (or is null: take it from config.json)."""
    if name is not None and name not in FAMILIES:
        raise ModelError(f"model.family={name!r} is not known. Allowed: {', '.join(sorted(FAMILIES))}. "
                         "Or use model=hf to take it from config.json.")


def family_of_config(hf_config: Any) -> Family | None:
    """The family of ``config.json``'s ``architectures`` entry, else of its ``model_type``; of a vision-language
    checkpoint, its text decoder's (``models.vision``)."""
    hf_config = language_config(hf_config)
    archs = list(getattr(hf_config, "architectures", None) or [])
    by_arch = next((f for arch in archs for f in FAMILIES.values() if arch in f.architectures), None)
    if by_arch is not None or archs:
        return by_arch
    model_type = getattr(hf_config, "model_type", None)
    return next((f for f in FAMILIES.values() if f.model_type == model_type), None)


def supported_architectures() -> str:
    return ", ".join(f"{arch} (model={f.name})" for f in FAMILIES.values() for arch in f.architectures)


# --- pieces several families share -------------------------------------------------------------


def _default_rope(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """One RoPE table for every layer; refuses longrope past its switch-over length."""
    cfg.standardize_rope_params()
    params = cfg.rope_parameters or {}
    original = params.get("original_max_position_embeddings")
    if params.get("rope_type") == "longrope" and original is not None and max_context_len > original:
        raise ModelError(
            f"this checkpoint uses longrope, which switches to its long-context frequencies past "
            f"original_max_position_embeddings={original} tokens; exporting a {max_context_len}-position cache "
            f"would need both sets in one program, which is not implemented. Use export.max_context_len<={original} (and export.max_seq_len no larger)."
        )
    return {"rope": (("default", rope_table(cfg)),)}


def _windows_by_layer_type(cfg: Any) -> tuple[int | None, ...]:
    """Sliding window on the layers ``layer_types`` marks ``sliding_attention`` (Qwen2/3, Gemma 2/3)."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    return tuple(window if t == "sliding_attention" else None for t in types)


def _window_on_every_layer(cfg: Any) -> tuple[int | None, ...]:
    """Mistral and Phi-3 slide every layer when ``sliding_window`` is set."""
    return (getattr(cfg, "sliding_window", None),) * cfg.num_hidden_layers


def _llama_biases(cfg: Any) -> dict[str, Any]:
    bias = bool(getattr(cfg, "attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(getattr(cfg, "mlp_bias", False))}


def _gemma_common(cfg: Any) -> dict[str, Any]:
    return {"unit_offset_norm": True, "embed_scale": cfg.hidden_size**0.5, **_llama_biases(cfg)}


# --- the families -------------------------------------------------------------------------------


@register_family("llama", "LlamaForCausalLM", model_type="llama")
def llama(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Llama 2 / 3 / 3.1 / 3.2 (incl. llama3 rope scaling), TinyLlama, SmolLM / SmolLM2."""
    return {**_llama_biases(cfg), **_default_rope(cfg, max_context_len)}


@register_family("granite", "GraniteForCausalLM", model_type="granite")
def granite(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """IBM Granite 3.x (and Granite Speech's text decoder): Llama with four multipliers, on the embeddings, the
    attention scores (in place of head_dim ** -0.5), each block's output before the residual add, and the logits
    (divided)."""
    return {**_llama_biases(cfg), **_default_rope(cfg, max_context_len), "embed_scale": cfg.embedding_multiplier,
            "attn_scale": cfg.attention_multiplier, "residual_scale": cfg.residual_multiplier,
            "logits_divisor": cfg.logits_scaling}


@register_family("mistral", "MistralForCausalLM", model_type="mistral")
def mistral(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Mistral 7B and its derivatives: Llama with a sliding window on every layer."""
    return {**_default_rope(cfg, max_context_len), "layer_window": _window_on_every_layer(cfg)}


@register_family("qwen2", "Qwen2ForCausalLM", model_type="qwen2")
def qwen2(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Qwen2 / Qwen2.5: biases on q, k and v (none on o_proj)."""
    return {"qkv_bias": True, **_default_rope(cfg, max_context_len), "layer_window": _windows_by_layer_type(cfg)}


@register_family("qwen3", "Qwen3ForCausalLM", model_type="qwen3")
def qwen3(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Qwen3 (dense): RMSNorm on q and k per head before RoPE."""
    return {
        "qk_norm": True, **_llama_biases(cfg), **_default_rope(cfg, max_context_len),
        "layer_window": _windows_by_layer_type(cfg),
    }


@register_family("phi3", "Phi3ForCausalLM", model_type="phi3")
def phi3(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv and gate_up projections, partial rotary, longrope."""
    return {
        "fused_qkv": True, "fused_gate_up": True, "hidden_act": cfg.hidden_act,
        **_default_rope(cfg, max_context_len), "layer_window": _window_on_every_layer(cfg),
    }


@register_family("gemma", "GemmaForCausalLM", model_type="gemma")
def gemma(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Gemma: RMSNorm with +1 offset, embeddings scaled by sqrt(hidden), GeGLU."""
    act = getattr(cfg, "hidden_activation", None) or cfg.hidden_act
    return {**_gemma_common(cfg), "hidden_act": act, **_default_rope(cfg, max_context_len)}


@register_family("gemma2", "Gemma2ForCausalLM", model_type="gemma2")
def gemma2(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Gemma 2: Gemma plus sandwich norms, logit soft-capping and alternating sliding-window layers."""
    return {
        **_gemma_common(cfg), "hidden_act": cfg.hidden_activation, "norms": Norms.sandwich,
        "attn_scale": cfg.query_pre_attn_scalar**-0.5,
        "attn_logit_softcap": cfg.attn_logit_softcapping, "final_logit_softcap": cfg.final_logit_softcapping,
        **_default_rope(cfg, max_context_len), "layer_window": _windows_by_layer_type(cfg),
    }


@register_family("gemma3", "Gemma3ForCausalLM", model_type="gemma3_text")
def gemma3(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Gemma 3 text models: Gemma 2 plus q/k norms and a separate RoPE for sliding-window layers."""
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ModelError("this Gemma 3 config uses bidirectional attention (an embedding model), not a causal LM.")
    cfg.standardize_rope_params()
    types = list(cfg.layer_types)
    return {
        **_gemma_common(cfg), "hidden_act": cfg.hidden_activation, "norms": Norms.sandwich, "qk_norm": True,
        "attn_scale": cfg.query_pre_attn_scalar**-0.5,
        "attn_logit_softcap": cfg.attn_logit_softcapping, "final_logit_softcap": cfg.final_logit_softcapping,
        "rope": tuple((t, rope_table(cfg, layer_type=t)) for t in sorted(set(types))),
        "layer_rope": tuple(types), "layer_window": _windows_by_layer_type(cfg),
    }


def _gemma4_kv_sources(cfg: Any) -> tuple[int | None, ...]:
    """Per layer, the layer whose cache it reads: transformers' ``kv_sharing_modes`` marks the last layers "reuse",
    each reading what the last "store" layer of its type wrote (``shared_kv_states[layer_type]``)."""
    stored: dict[str, int] = {}
    sources: list[int | None] = []
    for i, (mode, kind) in enumerate(zip(cfg.kv_sharing_modes, cfg.layer_types)):
        if mode == "reuse":
            if kind not in stored:
                raise ModelError(f"layer {i} of this Gemma 4 config reuses the keys and values of a {kind} layer, "
                                 "but no earlier layer of that type stores them. Fix num_kv_shared_layers in config.json.")
            sources.append(stored[kind])
        else:
            sources.append(None)
            if mode == "store":
                stored[kind] = i
    return tuple(sources)


def _gemma4_unused(cfg: Any) -> tuple[str, ...]:
    """KV-sharing layers' k/v projections and norms, which published checkpoints carry and transformers skips."""
    return tuple(f"model.layers.{i}.self_attn.{name}." for i, j in enumerate(_gemma4_kv_sources(cfg)) if j is not None
                 for name in ("k_proj", "v_proj", "k_norm", "v_norm"))


def _gemma4_tiny(vocab_size: int) -> dict[str, Any]:
    """Heads of 16 and 32 and a per-layer table of the tiny vocabulary, where transformers' defaults (E2B's: heads of
    256 and 512, 262144 rows) would make a 64-wide model of 135M parameters."""
    return {"head_dim": 16, "global_head_dim": 32, "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": vocab_size}


@register_family("gemma4", "Gemma4ForCausalLM", model_type="gemma4_text", unused_of=_gemma4_unused,
                 tiny_arch=_gemma4_tiny)
def gemma4(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Gemma 4 text models (E2B, E4B, 31B): Gemma 3's layers with unit-scale norms (and an unweighted one on values),
    head size and kv heads per layer type, partial "proportional" RoPE on full-attention layers, per-layer embeddings
    (PLE), a stored scalar per layer, and the last layers reading an earlier layer's cache (KV sharing) with twice the
    MLP width."""
    if getattr(cfg, "use_bidirectional_attention", None) == "all":  # "vision": only within an image's tokens
        raise ModelError("this Gemma 4 config uses bidirectional attention everywhere "
                         "(use_bidirectional_attention=all), not a causal LM's.")
    if getattr(cfg, "enable_moe_block", False):
        raise ModelError("this Gemma 4 config has mixture-of-experts layers (enable_moe_block), which this exporter "
                         "does not implement. The dense models (E2B, E4B, 31B) export.")
    cfg.standardize_rope_params()
    types, n = list(cfg.layer_types), cfg.num_hidden_layers
    layers = [cfg.per_layer_config[i] for i in range(n)]
    sources = _gemma4_kv_sources(cfg)
    wide = 2 if cfg.use_double_wide_mlp else 1
    return {
        "head_dim": layers[0].head_dim, "num_key_value_heads": layers[0].num_key_value_heads,
        "layer_head_dim": tuple(c.head_dim for c in layers),
        "layer_kv_heads": tuple(c.num_key_value_heads for c in layers),
        "layer_intermediate": tuple(cfg.intermediate_size * (wide if j is not None else 1) for j in sources),
        "layer_k_is_v": tuple(bool(cfg.attention_k_eq_v) and t != "sliding_attention" for t in types),
        "layer_kv_source": sources,
        "embed_scale": cfg.hidden_size**0.5, **_llama_biases(cfg), "mlp_bias": False,
        "hidden_act": cfg.hidden_activation, "norms": Norms.sandwich, "qk_norm": True, "v_norm": True,
        "norm_weight_fp32": True, "layer_scalar": True, "attn_scale": 1.0,
        "final_logit_softcap": cfg.final_logit_softcapping,
        "per_layer_input": cfg.hidden_size_per_layer_input or 0,
        "per_layer_vocab": cfg.vocab_size_per_layer_input if cfg.hidden_size_per_layer_input else 0,
        "rope": tuple((t, rope_table(cfg.per_layer_config[t], layer_type=t)) for t in sorted(set(types))),
        "layer_rope": tuple(types), "layer_window": _windows_by_layer_type(cfg),
        **_gemma4_media(cfg),
    }


def _gemma4_media(cfg: Any) -> dict[str, Any]:
    """Beside an image or audio encoder (``sees_images``, ``hears_audio``, set by
    ``models.multimodal.language_config``), the embeddings ``text_decoder`` takes carry their token ids: the per-layer
    embeddings look them up, an image's or a recording's tokens as the pad token (``placeholder_ids``, the
    multimodal config's image, audio and video token ids)."""
    if not (getattr(cfg, "sees_images", False) or getattr(cfg, "hears_audio", False)):
        return {}
    if cfg.pad_token_id is None:
        raise ModelError("this Gemma 4 config has no pad_token_id, whose per-layer embedding an image's or a "
                         "recording's tokens take (transformers' Gemma4Model): the checkpoint's config.json is "
                         "incomplete.")
    both_ways = getattr(cfg, "use_bidirectional_attention", None) == "vision"
    return {"id_channels": True, "placeholder_ids": tuple(getattr(cfg, "placeholder_ids", ())),
            "pad_token_id": int(cfg.pad_token_id),
            # transformers' create_masks_for_vision_model: sliding layers attend both ways within a run of image (or
            # video) tokens; full-attention layers stay causal
            "bidirectional_ids": tuple(getattr(cfg, "vision_ids", ())) if both_ways else (),
            "layer_bidirectional": tuple(both_ways and t == "sliding_attention" for t in cfg.layer_types)}


@register_family("smollm3", "SmolLM3ForCausalLM", model_type="smollm3")
def smollm3(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """SmolLM3: Llama with RoPE left out of every few layers (NoPE)."""
    rope = _default_rope(cfg, max_context_len)
    use_window = getattr(cfg, "use_sliding_window", False)
    return {
        **_llama_biases(cfg), **rope,
        "layer_rope": tuple("default" if keep else None for keep in cfg.no_rope_layers),
        "layer_window": _windows_by_layer_type(cfg) if use_window else (),
    }


@register_family("ministral3", "Ministral3ForCausalLM", model_type="ministral3")
def ministral3(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Ministral 3 (3B / 8B / 14B text decoders): Mistral with yarn RoPE, and queries scaled by
    ``1 + beta * log(1 + floor(position / original_max_position_embeddings))`` (Llama 4's long-context scale), which
    is exactly 1 below ``original_max_position_embeddings``: a cache that stays below it needs no scale at all."""
    cfg.standardize_rope_params()
    params = cfg.rope_parameters or {}
    beta, original = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if beta and original is not None and max_context_len > original:
        raise ModelError(
            f"this Ministral 3 checkpoint scales its queries by position past original_max_position_embeddings="
            f"{original} (llama_4_scaling_beta={beta}); a {max_context_len}-position cache would need that scale, which "
            f"is not implemented. Use export.max_context_len<={original} (and export.max_seq_len no larger)."
        )
    return mistral(cfg, max_context_len)


def _olmo(cfg: Any) -> dict[str, Any]:
    return {"qk_norm": True, "qk_norm_across_heads": True, "norms": Norms.post, **_llama_biases(cfg)}


@register_family("olmo2", "Olmo2ForCausalLM", model_type="olmo2")
def olmo2(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """OLMo 2 (AI2): norms on the attention and MLP outputs only, q and k normed across all heads at once."""
    return {**_olmo(cfg), **_default_rope(cfg, max_context_len)}


@register_family("olmo3", "Olmo3ForCausalLM", model_type="olmo3")
def olmo3(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """OLMo 3: OLMo 2 with sliding-window layers (``layer_types``), each layer type with its own RoPE."""
    cfg.standardize_rope_params()
    types, params = list(cfg.layer_types), cfg.rope_parameters or {}
    roped = sorted(t for t in set(types) if params.get(t) is not None)  # a type without parameters has no RoPE
    rope = {"rope": tuple((t, rope_table(cfg, layer_type=t)) for t in roped),
            "layer_rope": tuple(t if t in roped else None for t in types)}
    return {**_olmo(cfg), **rope, "layer_window": _windows_by_layer_type(cfg)}


LFM2_NAMES = (
    (r"^model\.embedding_norm\.", "model.norm."), (r"\.operator_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.feed_forward\.w1\.", ".mlp.gate_proj."),
    (r"\.feed_forward\.w3\.", ".mlp.up_proj."), (r"\.feed_forward\.w2\.", ".mlp.down_proj."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."), (r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm."),
    (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm."),
)
LFM2_MIXERS = {"full_attention": Mixer.attention, "conv": Mixer.short_conv}


def _mixers(cfg: Any, family: str, kinds: dict[str, Mixer]) -> tuple[Mixer, ...]:
    """Each layer's mixer from ``layer_types``; a type the family does not have is named."""
    unknown = sorted({t for t in cfg.layer_types if t not in kinds})
    if unknown:
        raise ModelError(f"layer_types names {unknown}, which {family} does not have. Allowed: {sorted(kinds)}. "
                         "Fix config.json's layer_types.")
    return tuple(kinds[t] for t in cfg.layer_types)


@register_family("lfm2", "Lfm2ForCausalLM", model_type="lfm2", renames=LFM2_NAMES)
def lfm2(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """LFM2 / LFM2.5 (Liquid AI): gated short convolutions interleaved with attention layers that norm q and k; the
    feed-forward width derived from the config as transformers derives it."""
    inter = cfg.intermediate_size
    if cfg.block_auto_adjust_ff_dim:  # transformers' Lfm2MLP
        inter = int(2 * inter / 3)
        if cfg.block_ffn_dim_multiplier is not None:
            inter = int(cfg.block_ffn_dim_multiplier * inter)
            inter = cfg.block_multiple_of * ((inter + cfg.block_multiple_of - 1) // cfg.block_multiple_of)
    return {
        "qk_norm": True, "intermediate_size": inter, "rms_norm_eps": cfg.norm_eps,
        "layer_mixer": _mixers(cfg, "LFM2", LFM2_MIXERS),
        "conv_kernel": cfg.conv_L_cache, "conv_bias": bool(cfg.conv_bias), **_default_rope(cfg, max_context_len),
    }


def _mrope_axes(cfg: Any, interleaved: bool) -> tuple[int, ...]:
    """M-RoPE's stream per rotary frequency from ``mrope_section`` (temporal, height, width counts): Qwen2.5-VL gives
    each stream a contiguous run of frequencies, Qwen3-VL interleaves them (T H W T H W ..., the rest temporal), as
    transformers' ``recomposition_frequencies`` of each composes cos and sin."""
    sections = list(cfg.rope_parameters["mrope_section"])
    if not interleaved:
        return tuple(axis for axis, count in enumerate(sections) for _ in range(count))
    return tuple(1 if i % 3 == 1 and i < 3 * sections[1] else 2 if i % 3 == 2 and i < 3 * sections[2] else 0
                 for i in range(sum(sections)))


@register_family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", model_type="qwen2_5_vl_text")
def qwen2_5_vl(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Qwen2.5-VL's text decoder: Qwen2 (biases on q, k, v) with M-RoPE in contiguous sections."""
    return {"qkv_bias": True, **_default_rope(cfg, max_context_len), "mrope_axes": _mrope_axes(cfg, False),
            "layer_window": _windows_by_layer_type(cfg)}  # a sliding window is refused with M-RoPE, by name


@register_family("qwen3_vl", "Qwen3VLForConditionalGeneration", model_type="qwen3_vl_text")
def qwen3_vl(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Qwen3-VL's text decoder: Qwen3 (q/k norms) with interleaved M-RoPE and deepstack: an image's features from
    several vision layers added after the first decoder layers (``deepstack_layers``, set from the vision config by
    ``models.multimodal.language_config``)."""
    return {"qk_norm": True, **_llama_biases(cfg), **_default_rope(cfg, max_context_len),
            "mrope_axes": _mrope_axes(cfg, True), "deepstack": int(getattr(cfg, "deepstack_layers", 0))}


QWEN3_5_MIXERS = {"full_attention": Mixer.attention, "linear_attention": Mixer.gated_delta}


@register_family("qwen3_5", "Qwen3_5ForCausalLM", model_type="qwen3_5_text", unused=("mtp.",))
def qwen3_5(cfg: Any, max_context_len: int) -> dict[str, Any]:
    """Qwen3.5 dense text models: Gated DeltaNet layers (a recurrent state per head) with every few layers a gated
    attention (q_proj also gives a sigmoid gate on the output), partial RoPE, norms scaling by ``1 + w``. Its M-RoPE
    sections (interleaved, as Qwen3-VL's) coincide for text, whose three position ids are equal: plain RoPE over the
    rotated dims for a text checkpoint, M-RoPE where the checkpoint sees images (``sees_images``)."""
    shape = GatedDeltaShape(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
    return {
        "qk_norm": True, "unit_offset_norm": True, "attn_output_gate": True, **_llama_biases(cfg),
        **_default_rope(cfg, max_context_len), "layer_mixer": _mixers(cfg, "Qwen3.5", QWEN3_5_MIXERS),
        "gated_delta": shape,
        "mrope_axes": _mrope_axes(cfg, True) if getattr(cfg, "sees_images", False) else (),
    }


def tensor_namer(hf_config: Any) -> Callable[[str], str | None]:
    """The decoder's name for each checkpoint tensor (None: another component's), for ``hf_config``'s layout."""
    family = family_of_config(hf_config)
    unused = () if family is None else family.unused
    if family is not None and family.unused_of is not None:
        unused += family.unused_of(language_config(hf_config))

    def name(stored: str) -> str | None:
        text = text_tensor_name(hf_config, stored)
        if text is None or text.startswith(unused):  # another component's, or one transformers skips
            return None
        return family.tensor_name(text) if family is not None else text

    return name


def _model_wide(cfg: Any, name: str) -> Any:
    """``cfg.<name>``, or None where the config has none or one per layer (Gemma 4's head_dim, which its adapter
    gives per layer)."""
    try:
        return getattr(cfg, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def decoder_args(hf_config: Any, max_context_len: int, source: str, family: str | None = None) -> DecoderArgs:
    """Map ``hf_config`` onto :class:`DecoderArgs` with the adapter of its ``architectures`` entry.

    ``family`` (from ``model=<family>``) must agree with the checkpoint; ``None`` accepts any family.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    found = family_of_config(hf_config)
    if found is None:
        given = archs or f"(none given; model_type {getattr(hf_config, 'model_type', None)!r})"
        raise ModelError(
            f"{source}: architecture {given} is not implemented by this exporter. "
            f"Supported architectures: {supported_architectures()}. "
            "Point model.checkpoint at a checkpoint of one of those families."
        )
    if family is not None and found.name != family:
        raise ModelError(
            f"{source}: model={family} expects {' or '.join(FAMILIES[family].architectures)}, but this checkpoint "
            f"is {found.architectures[0]}. Use model={found.name}, or model=hf to pick the family from config.json."
        )
    cfg = language_config(hf_config)
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": _model_wide(cfg, "num_key_value_heads") or cfg.num_attention_heads,
        "head_dim": _model_wide(cfg, "head_dim") or cfg.hidden_size // cfg.num_attention_heads,
        "rms_norm_eps": getattr(cfg, "rms_norm_eps", None),
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "max_context_len": max_context_len,
    }
    try:
        return DecoderArgs(**{**common, **found.adapt(cfg, max_context_len)})
    except ValueError as e:
        raise ModelError(
            f"{source}: inconsistent architecture: {e}. Fix config.json or the model.arch.* overrides."
        ) from e

