"""One exportable decoder for the Llama, Mistral, Qwen2/3, Phi-3, Gemma 1/2/3 and SmolLM3 families,
with a static KV cache held in buffers.

Module and parameter names follow Hugging Face's (``model.layers.0.self_attn.q_proj``, Phi-3's
``qkv_proj``, Gemma's ``pre_feedforward_layernorm`` ...), so a checkpoint's state dict loads 1:1 and
transformers' eager model is a direct reference. What differs between families is data in
:class:`DecoderArgs`, filled in by :mod:`models.families`.

Why not transformers' own model: its exportable static-cache wrapper fails in ``to_edge`` with
torch 2.13 (see docs/DESIGN.md). This module keeps everything ``torch.export`` and ExecuTorch like:

* the KV cache is a pair of fixed-size buffers per layer, ``[1, n_kv_heads, max_context_len, head_dim]``,
  with the same names in every exported method, so methods share them in the runtime;
* the cache update is ``index_copy_`` on those buffers (lowered to an in-place ``index_put_`` at emit);
* attention always covers the whole cache with a position mask, so shapes stay static except the
  number of new tokens ``T``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RopeTable:
    """Inverse RoPE frequencies and the cos/sin scale of one rope type (``models.families.rope_table`` reads
    them from a transformers config)."""

    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0


@dataclass(frozen=True)
class DecoderArgs:
    """Architecture of one decoder, independent of where its numbers came from.

    The family switches (biases, fused projections, q/k norms, Gemma's norms and soft-capping, sliding
    windows, per-layer RoPE) are data, set by a family adapter in :mod:`models.families`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: q/k/v have biases, o_proj has none
    o_bias: bool = False
    mlp_bias: bool = False
    fused_qkv: bool = False  # Phi-3: one qkv_proj, one gate_up_proj
    fused_gate_up: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k before RoPE
    unit_offset_norm: bool = False  # Gemma: RMSNorm scales by (1 + weight), in fp32
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    hidden_act: str = "silu"
    sandwich_norms: bool = False  # Gemma 2/3: norms before and after attention and MLP
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    max_context_len: int = 128
    # RoPE tables by name and, per layer, which table it uses (None: no RoPE in that layer, SmolLM3).
    rope: tuple[tuple[str, RopeTable], ...] = field(default=(), repr=False)
    layer_rope: tuple[str | None, ...] = ()
    # Per layer: sliding-window size, or None for full causal attention.
    layer_window: tuple[int | None, ...] = ()
    # "aten": portable ATen ops any backend can take; "custom_ops": ExecuTorch's llama::update_cache and
    # llama::custom_sdpa kernels (CPU: attends only to filled cache slots, the fast path for XNNPACK).
    attention: str = "aten"
    # What the KV cache stores (a key of KV_CACHES): "fp32", or "int8" codes with a scale and zero point per
    # token and head (llama::custom_quantized_sdpa; custom_ops attention only).
    kv_dtype: str = "fp32"

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not self.layer_rope:
            object.__setattr__(self, "layer_rope", (self.rope[0][0] if self.rope else None,) * n)
        if not self.layer_window:
            object.__setattr__(self, "layer_window", (None,) * n)
        # A window that covers the whole cache is plain causal attention.
        windows = tuple(None if w is None or w >= self.max_context_len else int(w) for w in self.layer_window)
        object.__setattr__(self, "layer_window", windows)
        if self.kv_dtype != "fp32" and self.attention != "custom_ops":
            raise ValueError(f"a {self.kv_dtype} KV cache needs ExecuTorch's LLM kernels (attention='custom_ops')")
        if len(self.layer_rope) != n or len(self.layer_window) != n:
            raise ValueError(f"layer_rope / layer_window need one entry per layer ({n})")
        unknown = {r for r in self.layer_rope if r is not None} - {name for name, _ in self.rope}
        if unknown:
            raise ValueError(f"layers use RoPE tables {sorted(unknown)} that are not defined")

    @property
    def n_rep(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def custom_ops_blockers(self) -> list[str]:
        """What ``llama::custom_sdpa`` cannot compute for this model (empty: the kernel fits)."""
        blockers = []
        if self.attn_logit_softcap is not None:
            blockers.append("attention logit soft-capping")
        if any(w is not None for w in self.layer_window):
            blockers.append("sliding-window layers shorter than the context")
        return blockers


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, exactly as transformers' ``LlamaRMSNorm`` or, with ``unit_offset``,
    ``GemmaRMSNorm`` (scale by ``1 + weight`` before casting back)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        if h.dim() == 3:  # [1, T, dim]: a 4-D mean over dims (2, 3) with -1 views, the form XNNPACK delegates
            mean_sq = (h * h).view(1, -1, h.shape[-1], 1).mean(dim=(2, 3), keepdim=True).view(1, -1, 1)
        else:
            mean_sq = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(mean_sq + self.variance_epsilon)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


Rope = tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin) for the new tokens, or None: no RoPE


class KVCache(nn.Module):
    """One layer's static cache for ATen attention: ``k_cache`` / ``v_cache`` [1, kv_heads, max_context, head_dim].

    The same buffer names in every exported method let the methods share one cache in the runtime; the
    update is ``index_copy_`` at the new tokens' positions (an in-place ``index_put_`` after emit).
    """

    def __init__(self, kv_heads: int, max_context: int, head_dim: int) -> None:
        super().__init__()
        shape = self.shape(kv_heads, max_context, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    @staticmethod
    def shape(kv_heads: int, max_context: int, head_dim: int) -> tuple[int, ...]:
        return (1, kv_heads, max_context, head_dim)

    def cache_dtype(self, activations: torch.dtype) -> torch.dtype:
        return activations

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write ``k`` / ``v`` [1, kv_heads, T, head_dim] at ``positions`` [T]."""
        self.k_cache.index_copy_(2, positions, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, positions, v.to(self.v_cache.dtype))

    @torch.no_grad()
    def rebuild(self, activations: torch.dtype, device: str | torch.device) -> None:
        """Empty buffers in the dtype this layout keeps for ``activations``, on ``device``."""
        dtype = self.cache_dtype(activations)
        self.k_cache = torch.zeros(self.k_cache.shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(self.v_cache.shape, dtype=dtype, device=device)

    @torch.no_grad()
    def reset(self) -> None:
        for buffer in self.buffers():
            buffer.zero_()

    @property
    def positions(self) -> int:
        return self.k_cache.shape[2]

    def bytes_per_position(self) -> int:
        """Bytes one cached position takes in this layer: keys, values and, when quantized, their scales."""
        return sum(b.numel() * b.element_size() for b in self.buffers()) // self.positions


class CustomOpsKVCache(KVCache):
    """The cache of ExecuTorch's LLM kernels: [1, max_context, kv_heads, head_dim], always fp32 (the kernels
    take fp32), written by ``llama::update_cache`` from the first new position on."""

    @staticmethod
    def shape(kv_heads: int, max_context: int, head_dim: int) -> tuple[int, ...]:
        return (1, max_context, kv_heads, head_dim)

    @property
    def positions(self) -> int:
        return self.k_cache.shape[1]

    def cache_dtype(self, activations: torch.dtype) -> torch.dtype:
        return torch.float32

    def update(self, k: torch.Tensor, v: torch.Tensor, start_pos: Any) -> None:  # type: ignore[override]
        """Write ``k`` / ``v`` [1, T, kv_heads, head_dim] from position ``start_pos`` (a SymInt) on."""
        torch.ops.llama.update_cache(k.float(), self.k_cache, start_pos)
        torch.ops.llama.update_cache(v.float(), self.v_cache, start_pos)

    def attend(self, q: torch.Tensor, start_pos: Any, scale: float) -> torch.Tensor:
        """Causal attention of ``q`` [1, T, heads, head_dim] at ``start_pos`` over the filled slots -> fp32, same shape."""
        return torch.ops.llama.custom_sdpa(q.float(), self.k_cache, self.v_cache, start_pos, None, 0.0, True, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 codes of ``x`` [..., head_dim] with an fp32 scale and int8 zero point per leading index (asymmetric, as
    ExecuTorch's export_llm quantizes its cache and query for ``llama::custom_quantized_sdpa``)."""
    import executorch.kernels.quantized  # noqa: F401  (the ops' out variants, which emit needs)
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed ops)

    qd = torch.ops.quantized_decomposed
    x = x.float()
    scales, zero_points = qd.choose_qparams_per_token_asymmetric.default(x, torch.int8)
    codes = qd.quantize_per_token(x, scales, zero_points, -128, 127, torch.int8)
    return codes, scales.float(), zero_points.to(torch.int8)


class QuantizedKVCache(CustomOpsKVCache):
    """An int8 cache for ExecuTorch's LLM kernels: codes [1, max_context, kv_heads, head_dim] with one fp32 scale and
    int8 zero point per position and head ([..., 1]): 4 + 1 bytes per head_dim bytes, 0.27x fp32's at head_dim 64.

    Written by ``llama::update_cache`` (codes, scales and zero points alike); read by
    ``llama::custom_quantized_sdpa``, which also takes the query quantized per token and head.
    """

    def __init__(self, kv_heads: int, max_context: int, head_dim: int) -> None:
        super().__init__(kv_heads, max_context, head_dim)
        scales = (1, max_context, kv_heads, 1)
        for side in ("k", "v"):
            self.register_buffer(f"{side}_cache_scales", torch.zeros(scales), persistent=False)
            self.register_buffer(f"{side}_cache_zero_points", torch.zeros(scales, dtype=torch.int8), persistent=False)

    def cache_dtype(self, activations: torch.dtype) -> torch.dtype:
        return torch.int8

    @torch.no_grad()
    def rebuild(self, activations: torch.dtype, device: str | torch.device) -> None:
        super().rebuild(activations, device)
        for side in ("k", "v"):
            setattr(self, f"{side}_cache_scales", torch.zeros_like(getattr(self, f"{side}_cache_scales"), device=device))
            setattr(self, f"{side}_cache_zero_points",
                    torch.zeros_like(getattr(self, f"{side}_cache_zero_points"), device=device))

    def update(self, k: torch.Tensor, v: torch.Tensor, start_pos: Any) -> None:  # type: ignore[override]
        for side, x in (("k", k), ("v", v)):
            codes, scales, zero_points = quantize_per_token(x)
            torch.ops.llama.update_cache(codes, getattr(self, f"{side}_cache"), start_pos)
            torch.ops.llama.update_cache(scales, getattr(self, f"{side}_cache_scales"), start_pos)
            torch.ops.llama.update_cache(zero_points, getattr(self, f"{side}_cache_zero_points"), start_pos)

    def attend(self, q: torch.Tensor, start_pos: Any, scale: float) -> torch.Tensor:
        codes, scales, zero_points = quantize_per_token(q)
        return torch.ops.llama.custom_quantized_sdpa(
            codes, self.k_cache, self.v_cache, start_pos, None, 0.0, True, scale,
            zero_points, scales, self.k_cache_zero_points, self.k_cache_scales,
            self.v_cache_zero_points, self.v_cache_scales)


# What the cache of ExecuTorch's LLM kernels stores, by DecoderArgs.kv_dtype.
KV_CACHES: dict[str, type[CustomOpsKVCache]] = {"fp32": CustomOpsKVCache, "int8": QuantizedKVCache}


class Attention(nn.Module):
    @staticmethod
    def cache_layout_of(args: DecoderArgs) -> type[KVCache]:
        return KVCache

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        h, kv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        if args.fused_qkv:
            self.qkv_proj = nn.Linear(args.hidden_size, (h + 2 * kv) * d, bias=args.qkv_bias)
        else:
            self.q_proj = nn.Linear(args.hidden_size, h * d, bias=args.qkv_bias)
            self.k_proj = nn.Linear(args.hidden_size, kv * d, bias=args.qkv_bias)
            self.v_proj = nn.Linear(args.hidden_size, kv * d, bias=args.qkv_bias)
        self.o_proj = nn.Linear(h * d, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps, args.unit_offset_norm)
            self.k_norm = RMSNorm(d, args.rms_norm_eps, args.unit_offset_norm)
        self.kv_cache = self.cache_layout_of(args)(kv, args.max_context_len, d)
        # rotate_half's matrix (rotate_half_matrix), one per projection: Core ML's converter takes each
        # constant once. Identical bytes, so the program stores them once.
        self.register_buffer("q_rotate", torch.empty(0), persistent=False)
        self.register_buffer("k_rotate", torch.empty(0), persistent=False)
        self.scale = args.scale

    def _qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, ...]:
        """Projections (q/k normed, RoPE applied), each [1, T, heads, head_dim].

        Shapes use -1 for the token dimension: a named symbolic size would stop XNNPACK from
        delegating the reshape in dynamic-length prefill and split the graph into many partitions.
        """
        a = self.args
        h, kv, d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        if a.fused_qkv:
            q, k, v = self.qkv_proj(x).split([h * d, kv * d, kv * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(1, -1, h, d), k.view(1, -1, kv, d), v.view(1, -1, kv, d)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope, self.q_rotate), apply_rope(k, *rope, self.k_rotate)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: Rope, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x, rope))  # [1, heads, T, d]
        a = self.args
        kv, rep, d = a.num_key_value_heads, a.n_rep, a.head_dim

        cache = self.kv_cache
        cache.update(k, v, positions)

        # Grouped-query attention without copying the cache: the n_rep query heads of one kv head are
        # stacked along the query axis, [1, kv, rep * T, d] against the [1, kv, max_context, d] cache.
        q = q.contiguous().view(1, kv, -1, d)
        scores = torch.matmul(q, cache.k_cache.transpose(2, 3)) * self.scale  # [1, kv, rep * T, max_context]
        if a.attn_logit_softcap is not None:
            scores = torch.tanh(scores / a.attn_logit_softcap) * a.attn_logit_softcap
        scores = scores.view(1, kv, rep, -1, a.max_context_len) + mask  # [1, kv, rep, T, max_context]
        probs = F.softmax(scores.float(), dim=-1).to(q.dtype).view(1, kv, -1, a.max_context_len)
        out = torch.matmul(probs, cache.v_cache).view(1, kv, rep, -1, d).permute(0, 3, 1, 2, 4)  # [1, T, kv, rep, d]
        out = out.contiguous().view(1, -1, a.num_attention_heads * d)  # [1, T, heads * d]
        return self.o_proj(out)


class CustomOpsAttention(Attention):
    """Attention on ExecuTorch's LLM kernels; the cache is laid out [1, max_context, kv_heads, head_dim].

    The kernel computes plain causal softmax attention: models with soft-capping or sliding windows
    use :class:`Attention` (see :meth:`DecoderArgs.custom_ops_blockers`).
    """

    @staticmethod
    def cache_layout_of(args: DecoderArgs) -> type[KVCache]:
        return KV_CACHES[args.kv_dtype]

    def __init__(self, args: DecoderArgs) -> None:
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers llama:: ops)

        blockers = args.custom_ops_blockers()
        if blockers:
            raise ValueError(f"llama::custom_sdpa cannot compute {', '.join(blockers)}; use attention='aten'")
        super().__init__(args)

    def forward(self, x: torch.Tensor, rope: Rope, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = self.args
        dtype = x.dtype
        q, k, v = self._qkv(x, rope)  # each [1, T, heads, d]: the kernels' layout, no transpose
        start_pos = positions[0].item()
        torch._check_is_size(start_pos)
        torch._check(start_pos < a.max_context_len)
        cache = self.kv_cache
        assert isinstance(cache, CustomOpsKVCache)
        cache.update(k, v, start_pos)
        # The kernels take fp32; casting around them is cheaper than doing without them.
        out = cache.attend(q, start_pos, self.scale)  # [1, T, heads, d]
        return self.o_proj(out.to(dtype).view(1, -1, a.num_attention_heads * a.head_dim))


ATTENTION: dict[str, type[Attention]] = {"aten": Attention, "custom_ops": CustomOpsAttention}


def rotate_half_matrix(dim: int) -> torch.Tensor:
    """R with ``F.linear(x, R) == cat(-x[..., dim/2:], x[..., :dim/2])`` (transformers' rotate_half).

    A linear with a constant 0/±1 weight is exact, and XNNPACK delegates it at any token count, where it
    does not delegate slices of a dynamic-length tensor: written with slices, RoPE split every layer of
    dynamic-length prefill into two partitions around four portable slice ops.
    """
    half = dim // 2
    rows = torch.arange(half)
    r = torch.zeros(dim, dim)
    r[rows, rows + half] = -1.0
    r[rows + half, rows] = 1.0
    return r


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` features of ``x`` [1, T, heads, d] (all unless rotary is partial)."""
    rot_dim = cos.shape[-1]
    if rot_dim == x.shape[-1]:
        return x * cos + F.linear(x, rotate.to(x.dtype)) * sin
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((x_rot * cos + F.linear(x_rot, rotate.to(x.dtype)) * sin, x_pass), dim=-1)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation, written out.

    ``F.gelu(x, approximate="tanh")`` is what transformers calls for Gemma, but ExecuTorch 1.4's
    XNNPACK delegate ignores ``approximate`` and computes exact GELU (off by up to ~5e-4 per
    activation; fixed upstream in pytorch/executorch#22851). Spelled out, every op is delegated as is.
    """
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


# Activations written here take precedence over transformers' ACT2FN of the same name.
ACTIVATIONS = {"gelu_pytorch_tanh": gelu_tanh, "gelu_new": gelu_tanh}


class MLP(nn.Module):
    """Gated MLP: SwiGLU (Llama, Qwen, Phi-3) or GeGLU (Gemma), split or fused gate/up projections."""

    def __init__(self, args: DecoderArgs) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.fused = args.fused_gate_up
        hidden, inter, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        if self.fused:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=bias)
            self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = ACTIVATIONS.get(args.hidden_act) or ACT2FN[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block; with ``sandwich_norms`` (Gemma 2/3) attention and MLP outputs are
    normed too, and ``post_attention_layernorm`` is the attention output's norm, as in transformers."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        norm = lambda: RMSNorm(args.hidden_size, args.rms_norm_eps, args.unit_offset_norm)  # noqa: E731
        self.sandwich = args.sandwich_norms
        self.self_attn = ATTENTION[args.attention](args)
        self.mlp = MLP(args)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x: torch.Tensor, rope: Rope, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, positions, mask)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """The ``model.`` prefix of a Hugging Face causal LM."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.unit_offset_norm)


class CausalLM(nn.Module):
    """``forward(tokens[1, T], input_pos[1]) -> logits[1, vocab]`` (last token), updating the KV cache.

    ``input_pos`` is the position of ``tokens[0, 0]``; the call writes positions
    ``input_pos .. input_pos + T - 1`` into the cache and attends to everything before them (within
    the layer's sliding window, if it has one).
    """

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderBody(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # True while lm_head and the embedding are one unquantized matrix (exporters.quant.tied decides it).
        self.tied_head = args.tie_word_embeddings
        if args.tie_word_embeddings:
            self.tie_weights()
        for name, _ in args.rope:
            self.register_buffer(f"rope_cos_{name}", torch.empty(0), persistent=False)
            self.register_buffer(f"rope_sin_{name}", torch.empty(0), persistent=False)
        self.register_buffer("cache_positions", torch.empty(0, dtype=torch.int64), persistent=False)
        # Python floats (not tensors, so export sees a constant): the scale rounded to each dtype.
        self.embed_scale = {
            dtype: float(torch.tensor(args.embed_scale or 1.0, dtype=dtype, device="cpu"))
            for dtype in (torch.float32, torch.float16, torch.bfloat16)
        }
        if self.model.norm.weight.device.type != "meta":
            self.init_buffers()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits from the final hidden states ``h`` [..., hidden] -> [..., vocab].

        A tied, unquantized matrix W [vocab, hidden] (``tied_head``; decided before capture, because
        ``torch.export`` gives tied parameters one placeholder each) is used as the embedding stores it,
        through the embedding's own parameter: ``(W @ h^T)^T``.
        ``h @ W^T`` would make ExecuTorch's constant propagation fold ``W^T`` into a second constant, and a
        delegate keep its own copy of W beside the embedding's: the largest matrix of a small model twice.
        """
        if self.tied_head:
            return (self.model.embed_tokens.weight @ h.mT).mT
        return self.lm_head(h)

    @torch.no_grad()
    def init_buffers(self, device: str | torch.device = "cpu") -> None:
        """(Re)build the non-persistent buffers: RoPE tables, cache positions and empty KV caches.

        Needed after building on the meta device and loading weights with ``assign=True``.
        """
        a = self.args
        steps = torch.arange(a.max_context_len, dtype=torch.float32, device=device)
        for name, table in a.rope:
            freqs = torch.outer(steps, torch.tensor(table.inv_freq, dtype=torch.float32, device=device))
            emb = torch.cat((freqs, freqs), dim=-1)
            setattr(self, f"rope_cos_{name}", emb.cos() * table.attention_scaling)
            setattr(self, f"rope_sin_{name}", emb.sin() * table.attention_scaling)
        self.cache_positions = torch.arange(a.max_context_len, device=device)
        dtype = self.activation_dtype()
        rot_dims = {name: 2 * len(table.inv_freq) for name, table in a.rope}
        for layer, rope in zip(self.model.layers, a.layer_rope):
            attn = layer.self_attn
            if rope is not None:
                attn.q_rotate = rotate_half_matrix(rot_dims[rope]).to(device)
                attn.k_rotate = rotate_half_matrix(rot_dims[rope]).to(device)
            attn.kv_cache.rebuild(dtype, device)

    def activation_dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype if self.lm_head.weight.is_floating_point() else torch.float32

    @contextmanager
    def kv_dtype_as(self, kv_dtype: str) -> Iterator[None]:
        """For a while, fresh empty caches that store ``kv_dtype`` instead of ``args.kv_dtype``: the same weights with
        an fp32 cache are the reference a quantized cache is measured against (baseline, validation)."""
        if kv_dtype == self.args.kv_dtype:
            yield
            return
        a = dataclasses.replace(self.args, kv_dtype=kv_dtype)
        attentions = [layer.self_attn for layer in self.model.layers]
        kept = [attn.kv_cache for attn in attentions]
        device = self.cache_positions.device
        for attn in attentions:
            attn.kv_cache = attn.cache_layout_of(a)(a.num_key_value_heads, a.max_context_len, a.head_dim)
            attn.kv_cache.rebuild(self.activation_dtype(), device)
        try:
            yield
        finally:
            for attn, cache in zip(attentions, kept):
                attn.kv_cache = cache

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states [1, T, hidden] of ``tokens`` [1, T], before the first layer."""
        h = self.model.embed_tokens(tokens)
        if self.args.embed_scale is not None:  # rounded to the activation dtype first, as transformers does
            h = h * self.embed_scale[h.dtype]
        return h

    def layer_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[Rope, torch.Tensor]]:
        """What each layer takes besides the hidden states, for tokens at ``positions`` [T]: its RoPE
        (cos, sin) and its additive mask over the whole cache."""
        a = self.args
        ropes: dict[str | None, Rope] = {None: None}
        for name, _ in a.rope:  # [T, 1, rot_dim]: broadcasts over heads
            cos = getattr(self, f"rope_cos_{name}")[positions].to(dtype).unsqueeze(1)
            sin = getattr(self, f"rope_sin_{name}")[positions].to(dtype).unsqueeze(1)
            ropes[name] = (cos, sin)
        # Additive masks over the whole cache: query at position p sees cache slots s <= p, and with a
        # sliding window w only p - w < s.
        slots, queries = self.cache_positions[None, :], positions[:, None]
        masks = {}
        for window in sorted(set(a.layer_window), key=lambda w: -1 if w is None else w):
            visible = slots <= queries if window is None else (slots <= queries) & (slots > queries - window)
            masks[window] = torch.where(visible, 0.0, float("-inf")).to(dtype)
        return [(ropes[rope], masks[window]) for rope, window in zip(a.layer_rope, a.layer_window)]

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, full_logits: bool = False) -> torch.Tensor:
        seq_len = tokens.shape[1]
        positions = input_pos[0] + torch.arange(seq_len, dtype=torch.int64)
        h = self.embed(tokens)
        for layer, (rope, mask) in zip(self.model.layers, self.layer_inputs(positions, h.dtype)):
            h = layer(h, rope, positions, mask)
        h = self.model.norm(h)
        if not full_logits:  # the last token's hidden state [1, hidden]
            # A view when T is a static 1 (decode), which XNNPACK delegates; it has no select, so a
            # dynamic-length method keeps one portable op here.
            h = h.view(1, -1) if isinstance(seq_len, int) and seq_len == 1 else h[:, -1, :]
        return self.softcap(self.head(h))

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        if self.args.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.args.final_logit_softcap) * self.args.final_logit_softcap
        return logits

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of every position from the last layer's hidden states ``h`` [1, T, hidden] (eager use:
        calibration and sensitivity run the layers one at a time)."""
        return self.softcap(self.head(self.model.norm(h)))

    @torch.no_grad()
    def reset_cache(self) -> None:
        """Zero every KV buffer, so a new sequence starts clean (eager runs: baseline, validation)."""
        for cache in self.kv_caches():
            cache.reset()

    def kv_caches(self) -> list[KVCache]:
        return [layer.self_attn.kv_cache for layer in self.model.layers]

    def kv_cache_buffers(self) -> list[str]:
        """Names of every buffer the KV caches hold (codes, and scales when quantized): the state methods share."""
        return [f"model.layers.{i}.self_attn.kv_cache.{name}"
                for i, cache in enumerate(self.kv_caches()) for name, _ in cache.named_buffers()]

    def kv_bytes_per_token(self) -> int:
        """Bytes one position of context takes in the cache, over every layer."""
        return sum(cache.bytes_per_position() for cache in self.kv_caches())
