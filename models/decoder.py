"""An exportable Llama-family decoder with a static KV cache held in buffers.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj``
...), so a checkpoint's state dict loads 1:1 and transformers' eager model is a direct reference.

Why not transformers' own model: its exportable static-cache wrapper fails in ``to_edge`` with
torch 2.13 (see DESIGN.md). This module keeps everything ``torch.export`` and ExecuTorch like:

* the KV cache is a pair of fixed-size buffers per layer, ``[1, n_kv_heads, max_context_len, head_dim]``,
  with the same names in every exported method, so methods share them in the runtime;
* the cache update is ``index_copy_`` on those buffers (lowered to an in-place ``index_put_`` at emit);
* attention always covers the whole cache with a position mask, so shapes stay static except the
  number of new tokens ``T``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DecoderArgs:
    """Architecture of one decoder, independent of where its numbers came from."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_context_len: int = 128
    # Inverse RoPE frequencies and the cos/sin scale, computed by transformers for the config's rope type.
    rope_inv_freq: tuple[float, ...] = field(default=(), repr=False)
    rope_attention_scaling: float = 1.0
    # "aten": portable ATen ops any backend can take; "custom_ops": ExecuTorch's llama::update_cache and
    # llama::custom_sdpa kernels (CPU: attends only to filled cache slots, the fast path for XNNPACK).
    attention: str = "aten"

    @property
    def n_rep(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


def rope_from_hf_config(hf_config: Any) -> tuple[tuple[float, ...], float]:
    """Inverse frequencies for the config's rope type, using transformers' own implementation.

    Covers ``default``, ``linear``, ``llama3``, ``yarn``, ``longrope`` ...: one source of truth, so the
    exported model cannot drift from the reference it is compared against.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
        dim = int(dim * partial)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return tuple(inv_freq.tolist()), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return tuple(inv_freq.float().tolist()), float(scaling)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 then cast back, exactly as transformers' ``LlamaRMSNorm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        if h.dim() == 3:  # [1, T, dim]: a 4-D mean over dims (2, 3) with -1 views, the form XNNPACK delegates
            mean_sq = (h * h).view(1, -1, h.shape[-1], 1).mean(dim=(2, 3), keepdim=True).view(1, -1, 1)
        else:
            mean_sq = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(mean_sq + self.variance_epsilon)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        h, kv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, h * d, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv * d, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv * d, bias=args.attention_bias)
        self.o_proj = nn.Linear(h * d, args.hidden_size, bias=args.attention_bias)
        cache_shape = (1, kv, args.max_context_len, d)
        self.register_buffer("k_cache", torch.zeros(cache_shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape), persistent=False)
        self.scale = 1.0 / math.sqrt(d)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Projections with RoPE applied, each [1, T, heads, head_dim].

        Shapes use -1 for the token dimension: a named symbolic size would stop XNNPACK from
        delegating the reshape in dynamic-length prefill and split the graph into many partitions.
        """
        a = self.args
        q = apply_rope(self.q_proj(x).view(1, -1, a.num_attention_heads, a.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(1, -1, a.num_key_value_heads, a.head_dim), cos, sin)
        v = self.v_proj(x).view(1, -1, a.num_key_value_heads, a.head_dim)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x, cos, sin))  # [1, heads, T, d]
        a = self.args
        kv, rep, d = a.num_key_value_heads, a.n_rep, a.head_dim

        self.k_cache.index_copy_(2, positions, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, positions, v.to(self.v_cache.dtype))

        # Grouped-query attention without copying the cache: the n_rep query heads of one kv head are
        # stacked along the query axis, [1, kv, rep * T, d] against the [1, kv, max_context, d] cache.
        q = q.contiguous().view(1, kv, -1, d)
        scores = torch.matmul(q, self.k_cache.transpose(2, 3)) * self.scale
        scores = scores.view(1, kv, rep, -1, a.max_context_len) + mask
        probs = F.softmax(scores.float(), dim=-1).to(q.dtype).view(1, kv, -1, a.max_context_len)
        out = torch.matmul(probs, self.v_cache).view(1, kv, rep, -1, d).permute(0, 3, 1, 2, 4)  # [1, T, kv, rep, d]
        out = out.contiguous().view(1, -1, a.num_attention_heads * d)
        return self.o_proj(out)


class CustomOpsAttention(Attention):
    """Attention on ExecuTorch's LLM kernels; the cache is laid out [1, max_context, kv_heads, head_dim]."""

    def __init__(self, args: DecoderArgs) -> None:
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers llama:: ops)

        super().__init__(args)
        shape = (1, args.max_context_len, args.num_key_value_heads, args.head_dim)
        self.k_cache = torch.zeros(shape)
        self.v_cache = torch.zeros(shape)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        a = self.args
        dtype = x.dtype
        q, k, v = self._qkv(x, cos, sin)
        start_pos = positions[0].item()
        torch._check_is_size(start_pos)
        torch._check(start_pos < a.max_context_len)
        # The kernels take fp32; casting around them is cheaper than doing without them.
        torch.ops.llama.update_cache(k.float(), self.k_cache, start_pos)
        torch.ops.llama.update_cache(v.float(), self.v_cache, start_pos)
        out = torch.ops.llama.custom_sdpa(q.float(), self.k_cache, self.v_cache, start_pos, None, 0.0, True, self.scale)
        return self.o_proj(out.to(dtype).view(1, -1, a.num_attention_heads * a.head_dim))


ATTENTION: dict[str, type[Attention]] = {"aten": Attention, "custom_ops": CustomOpsAttention}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` features of ``x`` [1, T, heads, d] (all unless rotary is partial)."""
    rot_dim = cos.shape[-1]
    if rot_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


class MLP(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.self_attn = ATTENTION[args.attention](args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, positions, mask):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """The ``model.`` prefix of a Hugging Face causal LM."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward(tokens[1, T], input_pos[1]) -> logits[1, vocab]`` (last token), updating the KV cache.

    ``input_pos`` is the position of ``tokens[0, 0]``; the call writes positions
    ``input_pos .. input_pos + T - 1`` into the cache and attends to everything before them.
    """

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderBody(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.tie_weights()
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.register_buffer("cache_positions", torch.empty(0, dtype=torch.int64), persistent=False)
        if self.model.norm.weight.device.type != "meta":
            self.init_buffers()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_buffers(self, device: str | torch.device = "cpu") -> None:
        """(Re)build the non-persistent buffers: RoPE tables, cache positions and empty KV caches.

        Needed after building on the meta device and loading weights with ``assign=True``.
        """
        a = self.args
        inv_freq = torch.tensor(a.rope_inv_freq, dtype=torch.float32, device=device)
        freqs = torch.outer(torch.arange(a.max_context_len, dtype=torch.float32, device=device), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = emb.cos() * a.rope_attention_scaling
        self.rope_sin = emb.sin() * a.rope_attention_scaling
        self.cache_positions = torch.arange(a.max_context_len, device=device)
        dtype = self.lm_head.weight.dtype if self.lm_head.weight.is_floating_point() else torch.float32
        for layer in self.model.layers:
            attn = layer.self_attn
            cache_dtype = torch.float32 if isinstance(attn, CustomOpsAttention) else dtype
            attn.k_cache = torch.zeros(attn.k_cache.shape, dtype=cache_dtype, device=device)
            attn.v_cache = torch.zeros(attn.v_cache.shape, dtype=cache_dtype, device=device)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, full_logits: bool = False) -> torch.Tensor:
        seq_len = tokens.shape[1]
        positions = input_pos[0] + torch.arange(seq_len, dtype=torch.int64)
        h = self.model.embed_tokens(tokens)
        cos = self.rope_cos[positions].to(h.dtype).unsqueeze(1)  # [T, 1, rot_dim]: broadcasts over heads
        sin = self.rope_sin[positions].to(h.dtype).unsqueeze(1)
        # Additive causal mask over the whole cache: query at position p sees cache slots <= p.
        visible = self.cache_positions[None, :] <= positions[:, None]
        mask = torch.where(visible, 0.0, float("-inf")).to(h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, positions, mask)
        h = self.model.norm(h)
        if not full_logits:
            h = h[:, -1, :]
        return self.lm_head(h)

    @torch.no_grad()
    def reset_cache(self) -> None:
        """Zero every KV buffer, so a new sequence starts clean (eager reference runs)."""
        for layer in self.model.layers:
            layer.self_attn.k_cache.zero_()
            layer.self_attn.v_cache.zero_()

    def kv_cache_buffers(self) -> list[str]:
        return [name for name, _ in self.named_buffers() if name.endswith(("k_cache", "v_cache"))]
