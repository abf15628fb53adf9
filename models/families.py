"""Which Hugging Face architectures this decoder implements, and how their configs map onto it.

A registry keyed by the ``architectures`` entry of ``config.json``: adding a family is one adapter
function here, no branching elsewhere.
"""

from __future__ import annotations

from typing import Any, Callable

from models.decoder import DecoderArgs, rope_from_hf_config
from models.errors import ModelError

ArgsAdapter = Callable[[Any, int], DecoderArgs]

FAMILIES: dict[str, ArgsAdapter] = {}


def register_family(*architectures: str) -> Callable[[ArgsAdapter], ArgsAdapter]:
    def wrap(fn: ArgsAdapter) -> ArgsAdapter:
        for arch in architectures:
            FAMILIES[arch] = fn
        return fn

    return wrap


@register_family("LlamaForCausalLM")
def llama_args(cfg: Any, max_context_len: int) -> DecoderArgs:
    """Llama 2 / 3 / 3.1 / 3.2 (incl. llama3 rope scaling), TinyLlama, SmolLM-style Llama variants."""
    inv_freq, scaling = rope_from_hf_config(cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return DecoderArgs(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        max_context_len=max_context_len,
        rope_inv_freq=inv_freq,
        rope_attention_scaling=scaling,
    )


def decoder_args(hf_config: Any, max_context_len: int, source: str) -> DecoderArgs:
    """Pick the adapter for ``hf_config.architectures``; an unknown one is a clear error."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch](hf_config, max_context_len)
    raise ModelError(
        f"{source}: architecture {archs or '(none given)'} is not implemented by this exporter. "
        f"Supported architectures: {', '.join(sorted(FAMILIES))}. "
        "Point model.checkpoint at a checkpoint of one of those families."
    )
