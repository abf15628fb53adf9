"""One exportable decoder for the Llama, Mistral, Qwen2/3, Phi-3, Gemma 1/2/3/4, SmolLM3, Ministral 3, OLMo 2/3 and the
hybrid LFM2 and Qwen3.5 families, with a static KV cache held in buffers (and, in hybrid models, the fixed-size state
of their other layers).

Module and parameter names follow Hugging Face's (``model.layers.0.self_attn.q_proj``, Phi-3's
``qkv_proj``, Gemma's ``pre_feedforward_layernorm`` ...), so a checkpoint's state dict loads 1:1 and
transformers' eager model is a direct reference. What differs between families is data in
:class:`DecoderArgs`, filled in by :mod:`models.families`.

Why not transformers' own model: its exportable static-cache wrapper fails in ``to_edge`` with
torch 2.13 (see docs/DESIGN.md). This module keeps everything ``torch.export`` and ExecuTorch like:

* the KV cache is a pair of fixed-size buffers per layer (:mod:`models.kv_cache`: linear, or a ring for sliding
  windows and attention sinks; fp32 or int8), with the same names in every exported method, so methods share
  them in the runtime;
* the cache update is ``index_copy_`` on those buffers (lowered to an in-place ``index_put_`` at emit), or
  ExecuTorch's ``llama::update_cache`` on the custom-ops path;
* attention covers the whole cache with a position mask (or the kernel's own causal bound), so shapes stay
  static except the number of new tokens ``T``;
* a hybrid model's other layers (LFM2's short convolutions, :mod:`models.short_conv`; Qwen3.5's Gated DeltaNet,
  :mod:`models.gated_delta`) keep their state in buffers named the same way in every method, beside the caches;
* Gemma 4's last layers own no cache: each attends over an earlier layer's (``layer_kv_source``), after that layer
  wrote the call's keys and values, as transformers' ``shared_kv_states`` does.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.casts import cast, fp32
from models.kv_cache import KV_CACHES, CacheGeometry, CustomOpsKVCache, KVCache
from models.gated_delta import GatedDeltaNet
from models.short_conv import ShortConv


class Norms(str, Enum):
    """Where a layer norms: before attention and MLP (Llama), before and after both (Gemma 2/3's sandwich), or only
    after both, on their outputs (OLMo 2/3: the residual stream goes into the projections unnormed)."""

    pre = "pre"
    sandwich = "sandwich"
    post = "post"


class Mixer(str, Enum):
    """What mixes a layer's tokens: attention over its KV cache, a short convolution over its last inputs (LFM2), or
    Gated DeltaNet's recurrence over a state matrix per head (Qwen3.5)."""

    attention = "attention"
    short_conv = "short_conv"
    gated_delta = "gated_delta"


@dataclass(frozen=True)
class GatedDeltaShape:
    """Qwen3.5's linear-attention layers: heads and head sizes of keys and values, the convolution's taps."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int


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
    qk_norm_across_heads: bool = False  # OLMo 2/3: that RMSNorm over every head's q (k) at once, before the heads split
    unit_offset_norm: bool = False  # Gemma: RMSNorm scales by (1 + weight), in fp32
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    hidden_act: str = "silu"
    norms: Norms = Norms.pre
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    residual_scale: float | None = None  # Granite: each block's output times residual_multiplier before it is added
    logits_divisor: float | None = None  # Granite: logits divided by logits_scaling
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
    # Attention sink: keep the first positions forever and ring the rest, so generation goes on past the cache
    # (every full-attention layer sees the sink and the last max_context_len - sink positions). 0 = off.
    attention_sink: int = 0
    # Most tokens one call writes (ring caches keep that many - 1 slots of headroom); None = max_context_len.
    call_tokens: int | None = None
    # Per layer, what mixes its tokens (empty: attention everywhere); a short convolution's taps and biases.
    layer_mixer: tuple[Mixer, ...] = ()
    conv_kernel: int = 3
    conv_bias: bool = False
    gated_delta: GatedDeltaShape | None = None  # the shape of the gated_delta layers (Qwen3.5)
    # Qwen3.5: q_proj gives each head's queries and as many gates; the attention output is multiplied by their sigmoid.
    attn_output_gate: bool = False
    # Gemma 4. Per layer (empty: the model-wide value everywhere): head size, kv heads, MLP width (its KV-sharing
    # layers' MLP is twice as wide), values taken from k_proj (no v_proj), and the earlier layer whose cache the layer
    # reads instead of keeping one (None: its own).
    layer_head_dim: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_intermediate: tuple[int, ...] = ()
    layer_k_is_v: tuple[bool, ...] = ()
    layer_kv_source: tuple[int | None, ...] = ()
    v_norm: bool = False  # values RMS-normed per head, without a weight
    norm_weight_fp32: bool = False  # RMSNorm scales by its weight in fp32, then casts (Gemma 4)
    layer_scalar: bool = False  # each layer's output multiplied by a stored scalar (Gemma 4's layer_scalar)
    # Per-layer embeddings (Gemma 4's PLE): each layer adds a gated projection of a per_layer_input-wide vector per
    # token, from a table of per_layer_vocab rows and a projection of the token's embedding. 0: none.
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    # M-RoPE (Qwen2.5-VL, Qwen3-VL, Qwen3.5 with images): per rotary frequency, the position stream (0 temporal,
    # 1 height, 2 width) its angle reads. Empty: plain RoPE. A text token's three positions are equal; an image's tokens
    # take their grid's.
    mrope_axes: tuple[int, ...] = ()
    # Qwen3-VL's deepstack: an image's features from as many vision layers, added after decoder layers 0, 1, ...
    deepstack: int = 0
    # Gemma 4 with images: an embedding carries its token's id (:data:`ID_DIGITS`), which the per-layer embeddings look
    # up; an image's, audio's or video's token (``placeholder_ids``) looks up ``pad_token_id``'s row, as transformers.
    id_channels: bool = False
    placeholder_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    # Gemma 4 with use_bidirectional_attention=vision: per layer, whether a run of these tokens (an image's, read from the
    # id channels) attends both ways within the call that carries it (an image comes whole in one call).
    bidirectional_ids: tuple[int, ...] = ()
    layer_bidirectional: tuple[bool, ...] = ()
    # Gemma 4's assistant (models.gemma4_drafter): every layer attends over another model's cache (its target's), so
    # none has k/v projections or a cache of its own; the drafter binds them.
    reads_other_caches: bool = False
    # Gemma 4 with its assistant: each position's final normed hidden state is kept (``CausalLM.final_hidden``), the
    # state the assistant starts its proposals from.
    keeps_final_hidden: bool = False

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
        for name, default in (("layer_head_dim", self.head_dim), ("layer_kv_heads", self.num_key_value_heads),
                              ("layer_intermediate", self.intermediate_size), ("layer_k_is_v", False),
                              ("layer_kv_source", None), ("layer_bidirectional", False)):
            if not getattr(self, name):
                object.__setattr__(self, name, (default,) * n)
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} needs one entry per layer ({n})")
        for i, kv in enumerate(self.layer_kv_heads):
            if self.num_attention_heads % kv:
                raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of layer {i}'s "
                                 f"{kv} key-value heads")
        for i, j in enumerate(self.layer_kv_source):
            if j is not None and not (0 <= j < i and self.layer_kv_source[j] is None
                                      and self.layer_window[j] == self.layer_window[i]
                                      and self.layer_head_dim[j] == self.layer_head_dim[i]
                                      and self.layer_kv_heads[j] == self.layer_kv_heads[i]):
                raise ValueError(f"layer {i} reads layer {j}'s KV cache, which must be an earlier layer with a cache "
                                 "of its own, of the same window, head size and kv heads")
        object.__setattr__(self, "layer_mixer", tuple(Mixer(m) for m in self.layer_mixer) or (Mixer.attention,) * n)
        # A window that covers the whole cache is plain causal attention.
        windows = tuple(None if w is None or w >= self.max_context_len else int(w) for w in self.layer_window)
        object.__setattr__(self, "layer_window", windows)
        if self.attention_sink and not 0 < self.attention_sink < self.max_context_len - self.max_call_tokens:
            raise ValueError(f"attention_sink={self.attention_sink} must leave room for a call of "
                             f"{self.max_call_tokens} tokens in a cache of {self.max_context_len}")
        if self.kv_dtype != "fp32" and self.attention != "custom_ops":
            raise ValueError(f"a {self.kv_dtype} KV cache needs ExecuTorch's LLM kernels (attention='custom_ops')")
        if len(self.layer_rope) != n or len(self.layer_window) != n or len(self.layer_mixer) != n:
            raise ValueError(f"layer_rope / layer_window / layer_mixer need one entry per layer ({n})")
        if self.conv_kernel < 2 and Mixer.short_conv in self.layer_mixer:
            raise ValueError(f"a short convolution of {self.conv_kernel} taps keeps no state; it needs 2 or more")
        if Mixer.gated_delta in self.layer_mixer:
            g = self.gated_delta
            if g is None:
                raise ValueError("gated_delta layers need their shape (GatedDeltaShape)")
            if g.value_heads % g.key_heads:  # llama::gated_delta_rule gives each key head whole value heads
                raise ValueError(f"linear_num_value_heads={g.value_heads} is not a multiple of "
                                 f"linear_num_key_heads={g.key_heads}")
            if g.conv_kernel < 2:
                raise ValueError(f"linear_conv_kernel_dim={g.conv_kernel} keeps no state; it needs 2 or more")
        unknown = {r for r in self.layer_rope if r is not None} - {name for name, _ in self.rope}
        if unknown:
            raise ValueError(f"layers use RoPE tables {sorted(unknown)} that are not defined")
        if self.mrope_axes:
            tables = {len(table.inv_freq) for _, table in self.rope}
            if tables != {len(self.mrope_axes)} or not set(self.mrope_axes) <= {0, 1, 2}:
                raise ValueError(f"mrope_axes needs one stream (0, 1 or 2) per rotary frequency ({sorted(tables)})")
            if self.attention_sink or any(w is not None for w in self.layer_window):
                raise ValueError("M-RoPE positions are kept per cache slot: a ring cache (attention sink or sliding "
                                 "window) is not supported with them")
        if self.deepstack >= self.num_hidden_layers:
            raise ValueError(f"deepstack={self.deepstack} needs as many decoder layers")
        if self.keeps_final_hidden and self.attention_sink:
            raise ValueError("final hidden states are kept by position, up to max_context_len: an attention sink's "
                             "endless positions have no place in them")
        if self.bidirectional_ids and not self.id_channels:
            raise ValueError("bidirectional image runs are found by token id, which only id_channels carry")
        if self.id_channels and not self.per_layer_input:
            raise ValueError("id_channels carry token ids to the per-layer embeddings, which this model has none of")

    @property
    def embedding_width(self) -> int:
        """Channels of the embeddings ``text_decoder`` takes: the hidden size; for M-RoPE, then the deepstack
        features and an image position's three (:data:`IMAGE_CHANNELS`), so any call carries what an image needs;
        with ``id_channels``, then the token's id (:data:`ID_DIGITS`)."""
        width = self.hidden_size * (1 + self.deepstack)
        if self.mrope_axes:
            width += len(IMAGE_CHANNELS)
        return width + (ID_DIGITS if self.id_channels else 0)

    @property
    def wide_embeddings(self) -> bool:
        """``text_decoder`` takes more than the hidden states (:attr:`embedding_width`)."""
        return self.embedding_width != self.hidden_size

    def for_layer(self, i: int) -> DecoderArgs:
        """These arguments with layer ``i``'s head size, kv heads and MLP width as the model-wide ones: what its
        attention and MLP are built from."""
        shape = {"head_dim": self.layer_head_dim[i], "num_key_value_heads": self.layer_kv_heads[i],
                 "intermediate_size": self.layer_intermediate[i]}
        if all(getattr(self, k) == v for k, v in shape.items()):
            return self
        return dataclasses.replace(self, **shape)

    @property
    def per_layer_shapes(self) -> bool:
        """Layers differ in head size, kv heads, MLP width or cache (Gemma 4): what a transform written for one
        shape of every layer (quant.rotation) cannot take."""
        return (len(set(self.layer_head_dim)) > 1 or len(set(self.layer_kv_heads)) > 1
                or len(set(self.layer_intermediate)) > 1 or any(j is not None for j in self.layer_kv_source))

    @property
    def max_call_tokens(self) -> int:
        return self.call_tokens if self.call_tokens is not None else self.max_context_len

    @property
    def layer_geometry(self) -> tuple[CacheGeometry, ...]:
        """Each layer's cache: linear, or a ring for windows shorter than the cache and for attention sinks."""
        return tuple(CacheGeometry.of(self.max_context_len, w, self.attention_sink, self.max_call_tokens)
                     for w in self.layer_window)

    @property
    def hybrid(self) -> bool:
        """Some layers keep a state that is not a KV cache (it cannot be rolled back by position)."""
        return any(m != Mixer.attention for m in self.layer_mixer)

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
        return blockers


def mean_last(h: torch.Tensor) -> torch.Tensor:
    """The mean over the last dimension (kept) of ``[1, T, dim]`` or ``[1, T, heads, head_dim]``, as a 4-D mean over
    dims (2, 3) with -1 views: the form XNNPACK delegates (it takes no mean over the last dim alone, which would end
    the delegated partition there: one more delegate call per layer and step)."""
    return h.view(1, -1, h.shape[-1], 1).mean(dim=(2, 3), keepdim=True).view(1, -1, *h.shape[2:-1], 1)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, exactly as transformers' ``LlamaRMSNorm``; with ``unit_offset`` ``GemmaRMSNorm``
    (scale by ``1 + weight`` before casting back); with ``weight_fp32`` Gemma 4's (scale by ``weight`` before casting
    back); with ``scaled=False`` no weight at all (Gemma 4's ``v_norm``)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False, weight_fp32: bool = False,
                 scaled: bool = True) -> None:
        super().__init__()
        self.unit_offset = unit_offset
        self.weight_fp32 = weight_fp32 or unit_offset
        self.scaled = scaled
        if scaled:
            self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = fp32(x)
        if h.dim() in (3, 4):  # [1, T, dim], or [1, T, heads, head_dim] (Qwen3's and Gemma 3's q/k norms)
            mean_sq = mean_last(h * h)
        else:
            mean_sq = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(mean_sq + self.variance_epsilon)
        if not self.scaled:
            return cast(h, dtype)
        if self.weight_fp32:
            return cast(h * ((1.0 + fp32(self.weight)) if self.unit_offset else fp32(self.weight)), dtype)
        return self.weight * cast(h, dtype)


Rope = tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin) for the new tokens, or None: no RoPE


#: The last channels of a wide embedding (M-RoPE): for an image's token, 1 + its index in the image (row by row) and the
#: image's rows and columns of positions; zeros for text.
IMAGE_CHANNELS = ("place", "rows", "columns")

#: A token id in a wide embedding (Gemma 4 with images): base-256 digits, least significant first, each exact in
#: bf16 and fp16 (whole numbers to 256 and 2048) where one channel of a 262144-token vocabulary's ids would be rounded.
ID_DIGITS, ID_BASE = 3, 256


def id_digits(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Token ids [..., T] as their :data:`ID_DIGITS` channels [..., T, 3] in ``dtype``."""
    places = ID_BASE ** torch.arange(ID_DIGITS, device=ids.device)
    return torch.div(ids.unsqueeze(-1), places, rounding_mode="floor").remainder(ID_BASE).to(dtype)


def ids_of_digits(digits: torch.Tensor) -> torch.Tensor:
    """The token ids [1, T] of their digit channels [1, T, 3] (whole numbers in any float dtype: exact)."""
    d = digits.to(torch.int64)
    return d[..., 0] + d[..., 1] * ID_BASE + d[..., 2] * (ID_BASE * ID_BASE)


class WideEmbedding(NamedTuple):
    """The parts of a wide embedding (:attr:`DecoderArgs.embedding_width`)."""

    states: torch.Tensor  # the hidden states [1, T, hidden]
    deep: list[torch.Tensor]  # Qwen3-VL's deepstack features, added after the first layers
    image: torch.Tensor | None  # M-RoPE's image channels [T, 3] (IMAGE_CHANNELS)
    ids: torch.Tensor | None  # the token ids [1, T] (id_channels)


class LayerInputs(NamedTuple):
    """What a layer takes besides the hidden states (``CausalLM.layer_inputs``)."""

    rope: Rope
    mask: torch.Tensor  # additive [T, slots] over its cache
    slots: torch.Tensor  # [T]: where the new tokens' keys and values go


class Attention(nn.Module):
    """Attention of layer ``layer``, built from that layer's arguments (:meth:`DecoderArgs.for_layer`).

    A layer whose ``layer_kv_source`` names an earlier one (Gemma 4's KV sharing) has neither k/v projections nor a
    cache: it attends over that layer's cache (:meth:`read_cache_of`), which the layer wrote earlier in the call."""

    @staticmethod
    def cache_layout_of(args: DecoderArgs) -> type[KVCache]:
        return KVCache

    def __init__(self, args: DecoderArgs, geometry: CacheGeometry, layer: int = 0) -> None:
        super().__init__()
        self.args = args
        self.layer = layer
        self.shares_cache = args.layer_kv_source[layer] is not None or args.reads_other_caches
        self.k_is_v = args.layer_k_is_v[layer]
        h, kv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        if args.fused_qkv:
            self.qkv_proj = nn.Linear(args.hidden_size, (h + 2 * kv) * d, bias=args.qkv_bias)
        else:
            self.q_proj = nn.Linear(args.hidden_size, h * d * (2 if args.attn_output_gate else 1), bias=args.qkv_bias)
            if not self.shares_cache:
                self.k_proj = nn.Linear(args.hidden_size, kv * d, bias=args.qkv_bias)
                if not self.k_is_v:
                    self.v_proj = nn.Linear(args.hidden_size, kv * d, bias=args.qkv_bias)
        self.o_proj = nn.Linear(h * d, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            q_width, k_width = (h * d, kv * d) if args.qk_norm_across_heads else (d, d)
            self.q_norm = RMSNorm(q_width, args.rms_norm_eps, args.unit_offset_norm, args.norm_weight_fp32)
            if not self.shares_cache:
                self.k_norm = RMSNorm(k_width, args.rms_norm_eps, args.unit_offset_norm, args.norm_weight_fp32)
        if args.v_norm and not self.shares_cache:
            self.v_norm = RMSNorm(d, args.rms_norm_eps, scaled=False)
        # A plain attribute, not a submodule: the owner's cache is registered (and exported) once, under its layer.
        self._cache_owner: Attention | None = None
        if not self.shares_cache:
            self.kv_cache = self.cache_layout_of(args)(kv, geometry, d)
        # rotate_half's matrix (rotate_half_matrix), one per projection: Core ML's converter takes each
        # constant once. Identical bytes, so the program stores them once.
        self.register_buffer("q_rotate", torch.empty(0), persistent=False)
        self.register_buffer("k_rotate", torch.empty(0), persistent=False)
        self.scale = args.scale

    def read_cache_of(self, owner: Attention) -> None:
        """From now on attend over ``owner``'s cache (KV sharing); ``owner`` runs first in every call."""
        assert self.shares_cache and not owner.shares_cache
        object.__setattr__(self, "_cache_owner", owner)

    def cache(self) -> KVCache:
        if not self.shares_cache:
            return self.kv_cache
        owner = self._cache_owner
        assert owner is not None, "a layer that shares a cache was not given its owner (DecoderBody binds them)"
        return owner.kv_cache

    def _qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, ...]:
        """Projections (q/k normed, RoPE applied), each [1, T, heads, head_dim], and the output gate [1, T, heads *
        head_dim] (None without ``attn_output_gate``); k and v are None in a layer that reads another's cache.

        Shapes use -1 for the token dimension: a named symbolic size would stop XNNPACK from
        delegating the reshape in dynamic-length prefill and split the graph into many partitions.
        """
        a = self.args
        h, kv, d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        if self.shares_cache:
            q = self.q_proj(x).view(1, -1, h, d)
            if a.qk_norm:
                q = self.q_norm(q)
            return (q if rope is None else apply_rope(q, *rope, self.q_rotate)), None, None, None
        if a.fused_qkv:
            q, k, v = self.qkv_proj(x).split([h * d, kv * d, kv * d], dim=-1)
        else:
            q, k = self.q_proj(x), self.k_proj(x)
            v = k if self.k_is_v else self.v_proj(x)  # Gemma 4's attention_k_eq_v: values are the unnormed keys
        gate = None
        if a.attn_output_gate:  # per head: d queries, then d gates
            q, gate = q.view(1, -1, h, 2 * d).chunk(2, dim=-1)
            gate = gate.reshape(1, -1, h * d)
        if a.qk_norm and a.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(1, -1, h, d), k.view(1, -1, kv, d), v.view(1, -1, kv, d)
        if a.qk_norm and not a.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if a.v_norm:
            v = self.v_norm(v)
        if rope is not None:
            q, k = apply_rope(q, *rope, self.q_rotate), apply_rope(k, *rope, self.k_rotate)
        return q, k, v, gate

    @staticmethod
    def gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return out if gate is None else out * torch.sigmoid(gate)

    def forward(self, x: torch.Tensor, rope: Rope, positions: torch.Tensor, mask: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        q, k, v, gate = self._qkv(x, rope)
        q = q.transpose(1, 2)  # [1, heads, T, d]
        a = self.args
        kv, rep, d = a.num_key_value_heads, a.n_rep, a.head_dim

        cache = self.cache()
        if not self.shares_cache:
            cache.update(k.transpose(1, 2), v.transpose(1, 2), slots)
        n = cache.geometry.slots

        # Grouped-query attention without copying the cache: the n_rep query heads of one kv head are
        # stacked along the query axis, [1, kv, rep * T, d] against the [1, kv, slots, d] cache.
        q = q.contiguous().view(1, kv, -1, d)
        scores = torch.matmul(q, cache.k_cache.transpose(2, 3)) * self.scale  # [1, kv, rep * T, slots]
        if a.attn_logit_softcap is not None:
            scores = torch.tanh(scores / a.attn_logit_softcap) * a.attn_logit_softcap
        scores = scores.view(1, kv, rep, -1, n) + mask  # [1, kv, rep, T, slots]
        probs = cast(F.softmax(fp32(scores), dim=-1), q.dtype).view(1, kv, -1, n)
        out = torch.matmul(probs, cache.v_cache).view(1, kv, rep, -1, d).permute(0, 3, 1, 2, 4)  # [1, T, kv, rep, d]
        out = out.contiguous().view(1, -1, a.num_attention_heads * d)  # [1, T, heads * d]
        return self.o_proj(self.gated(out, gate))


class CustomOpsAttention(Attention):
    """Attention on ExecuTorch's LLM kernels; the cache is laid out [1, slots, kv_heads, head_dim].

    The kernel computes softmax attention, causal or under a mask (sliding windows, rings): models with
    soft-capping use :class:`Attention` (see :meth:`DecoderArgs.custom_ops_blockers`).
    """

    @staticmethod
    def cache_layout_of(args: DecoderArgs) -> type[KVCache]:
        return KV_CACHES[args.kv_dtype]

    def __init__(self, args: DecoderArgs, geometry: CacheGeometry, layer: int = 0) -> None:
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers llama:: ops)

        blockers = args.custom_ops_blockers()
        if blockers:
            raise ValueError(f"llama::custom_sdpa cannot compute {', '.join(blockers)}; use attention='aten'")
        super().__init__(args, geometry, layer)

    def forward(self, x: torch.Tensor, rope: Rope, positions: torch.Tensor, mask: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        a = self.args
        dtype = x.dtype
        q, k, v, gate = self._qkv(x, rope)  # each [1, T, heads, d]: the kernels' layout, no transpose
        cache = self.cache()
        assert isinstance(cache, CustomOpsKVCache)
        start_pos = positions[0].item()
        torch._check(start_pos >= 0)  # a position (torch._check_is_size is deprecated: it says to use this)
        if not cache.geometry.ring:  # a ring takes any position
            torch._check(start_pos < cache.geometry.slots)
        if not self.shares_cache:
            cache.update(k, v, slots, start_pos)
        # The kernels take fp32; casting around them is cheaper than doing without them.
        # A plain cache is causal from start_pos (the kernel's own bound), unless an image's tokens see each other
        causal = cache.geometry.plain and not a.layer_bidirectional[self.layer]
        out = cache.attend(q, start_pos, None if causal else mask, self.scale)  # [1, T, heads, d]
        return self.o_proj(self.gated(cast(out, dtype).view(1, -1, a.num_attention_heads * a.head_dim), gate))


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
        return x * cos + F.linear(x, cast(rotate, x.dtype)) * sin
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((x_rot * cos + F.linear(x_rot, cast(rotate, x.dtype)) * sin, x_pass), dim=-1)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation, written out.

    ``F.gelu(x, approximate="tanh")`` is what transformers calls for Gemma, but ExecuTorch 1.4's
    XNNPACK delegate ignores ``approximate`` and computes exact GELU (off by up to ~5e-4 per
    activation; fixed upstream in pytorch/executorch#22851). Spelled out, every op is delegated as is.
    """
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


# Activations written here take precedence over transformers' ACT2FN of the same name.
ACTIVATIONS = {"gelu_pytorch_tanh": gelu_tanh, "gelu_new": gelu_tanh}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config names: ours (:data:`ACTIVATIONS`), else transformers' ``ACT2FN``."""
    from transformers.activations import ACT2FN

    return ACTIVATIONS.get(name) or ACT2FN[name]


def in_each_dtype(value: float) -> dict[torch.dtype, float]:
    """``value`` rounded to each activation dtype, as Python floats (export sees a constant): transformers scales
    embeddings by a tensor of the weights' dtype."""
    return {dtype: float(torch.tensor(value, dtype=dtype, device="cpu"))
            for dtype in (torch.float32, torch.float16, torch.bfloat16)}


class Rotation(nn.Module):
    """A constant orthogonal matrix applied at run time to ``x`` [1, T, n]: the parts of a rotation
    (``quant.rotation``, ``exporters.quant.rotation``) that cannot be folded into weights.

    The matrix is a Kronecker product ``M_1 x ... x M_k`` of small factors (one factor: any dense matrix), applied
    as ``x`` viewed [T, f_1, ..., f_k], one factor per axis: n * (f_1 + ... + f_k) multiply-adds instead of n^2, each
    a linear and a permute that XNNPACK delegates at any T. ``forward`` computes ``(M_1 x ... x M_k) x`` per token.
    """

    def __init__(self, factors: list[torch.Tensor]) -> None:
        super().__init__()
        self.orders = tuple(f.shape[0] for f in factors)
        for i, factor in enumerate(factors):
            self.register_buffer(f"matrix_{i}", factor, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.orders)
        if k == 1:
            return F.linear(x, cast(self.matrix_0, x.dtype))
        y = x.view(-1, *self.orders)
        axes = (0, k, *range(1, k))  # the axis just transformed moves first, the next one comes last
        for i in reversed(range(k)):
            y = F.linear(y, cast(getattr(self, f"matrix_{i}"), x.dtype)).permute(axes)
        return y.contiguous().view(1, -1, x.shape[-1])


# Names (a module path, or a graph's flattened one) of the constants the model multiplies by: RoPE's rotate_half
# and a Rotation's factors. They are exact in float and not weights: no quantizer touches them.
CONSTANT_MATRIX = re.compile(r"(q_rotate|k_rotate|matrix_\d+)$")


def is_constant_matrix(name: str) -> bool:
    return CONSTANT_MATRIX.search(name) is not None


def rotated(rotation: Rotation | None, x: torch.Tensor) -> torch.Tensor:
    return x if rotation is None else rotation(x)


class MLP(nn.Module):
    """Gated MLP: SwiGLU (Llama, Qwen, Phi-3) or GeGLU (Gemma), split or fused gate/up projections."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.fused = args.fused_gate_up
        hidden, inter, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        if self.fused:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=bias)
            self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = activation(args.hidden_act)
        self.down_input_rotation: Rotation | None = None  # quant.online_hadamard (R4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(rotated(self.down_input_rotation, self.act_fn(gate) * up))


# Each mixer's module in a layer, by transformers' attribute name (checkpoints load 1:1).
MIXER_MODULES = {Mixer.attention: "self_attn", Mixer.short_conv: "conv", Mixer.gated_delta: "linear_attn"}


class DecoderLayer(nn.Module):
    """Residual block normed where ``args.norms`` says: with sandwich norms (Gemma 2/3) and post norms (OLMo 2/3)
    ``post_attention_layernorm`` is the attention output's norm, as in transformers; with post norms there is no
    ``input_layernorm``."""

    def __init__(self, args: DecoderArgs, geometry: CacheGeometry, mixer: Mixer = Mixer.attention,
                 index: int = 0) -> None:
        super().__init__()
        norm = lambda: RMSNorm(args.hidden_size, args.rms_norm_eps, args.unit_offset_norm, args.norm_weight_fp32)  # noqa: E731
        self.norms = args.norms
        self.residual_scale = args.residual_scale
        self.mixer = mixer
        args = args.for_layer(index)
        if mixer == Mixer.attention:
            self.self_attn = ATTENTION[args.attention](args, geometry, index)
        elif mixer == Mixer.short_conv:
            self.conv = ShortConv(args.hidden_size, args.conv_kernel, args.conv_bias)
        else:
            g = args.gated_delta
            assert g is not None
            self.linear_attn = GatedDeltaNet(args.hidden_size, g.key_heads, g.value_heads, g.key_dim, g.value_dim,
                                             g.conv_kernel, args.rms_norm_eps)
        self.mlp = MLP(args)
        if self.norms != Norms.post:
            self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if self.norms == Norms.sandwich:
            self.pre_feedforward_layernorm = norm()
        if self.norms != Norms.pre:
            self.post_feedforward_layernorm = norm()
        if args.per_layer_input:  # Gemma 4's per-layer embeddings: a gated projection of this layer's vector
            self.per_layer_input_gate = nn.Linear(args.hidden_size, args.per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(args.per_layer_input, args.hidden_size, bias=False)
            self.post_per_layer_input_norm = norm()
            self.per_layer_act = activation(args.hidden_act)
        if args.layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1))
        # quant.rotation with sandwich norms: the normed block outputs rotated into the residual stream's basis.
        self.output_rotation: Rotation | None = None

    @property
    def holds_state(self) -> bool:
        """False for a layer that reads another layer's KV cache (Gemma 4): it keeps nothing between calls."""
        return self.mixer != Mixer.attention or not self.self_attn.shares_cache

    def residual(self, out: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the residual stream (Granite scales it by residual_multiplier)."""
        return out if self.residual_scale is None else out * self.residual_scale

    def recurrent(self) -> ShortConv | GatedDeltaNet:
        """The mixer of a layer that is not attention, whose state is not a KV cache."""
        return getattr(self, MIXER_MODULES[self.mixer])

    def state(self) -> tuple[str, KVCache | ShortConv | GatedDeltaNet]:
        """The module holding the layer's state (each has ``reset``, ``bytes`` and its buffers) and its path in the
        layer: the KV cache, or the recurrent mixer itself."""
        if self.mixer == Mixer.attention:
            return "self_attn.kv_cache", self.self_attn.kv_cache
        return MIXER_MODULES[self.mixer], self.recurrent()

    def forward(self, x: torch.Tensor, rope: Rope, positions: torch.Tensor, mask: torch.Tensor,
                slots: torch.Tensor, per_layer: torch.Tensor | None = None) -> torch.Tensor:
        """``per_layer`` [1, T, per_layer_input]: this layer's per-layer embedding (Gemma 4), else None."""
        h = x if self.norms == Norms.post else self.input_layernorm(x)
        if self.mixer == Mixer.attention:
            attn = self.self_attn(h, rope, positions, mask, slots)
        else:
            attn = self.recurrent()(h, positions)
        if self.norms == Norms.pre:
            x = x + self.residual(attn)
            return x + self.residual(self.mlp(self.post_attention_layernorm(x)))
        x = x + rotated(self.output_rotation, self.post_attention_layernorm(attn))
        mlp = self.mlp(self.pre_feedforward_layernorm(x) if self.norms == Norms.sandwich else x)
        x = x + rotated(self.output_rotation, self.post_feedforward_layernorm(mlp))
        if per_layer is not None:
            gated = self.per_layer_act(self.per_layer_input_gate(x)) * per_layer
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        # Gemma 4's scalar in the activation dtype, as transformers stores it (a bf16 model's is bf16)
        return x * cast(self.layer_scalar, x.dtype) if hasattr(self, "layer_scalar") else x


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose eager lookup in a table torchao quantized (``IntxUnpackedToInt8Tensor``) dequantizes only
    the rows it reads. torchao's own lookup dequantizes the whole table at every call, about twice its fp32 size in
    temporaries: 2 GB for a 1 GB table (measured), 19 GB a call for Gemma 4 E2B's 2.35B-parameter per-layer table,
    which is what killed its validation. The rows are dequantized by the same tensor type's own ``dequantize``, so
    they are the same values. Under ``torch.export`` the lookup stays torchao's: its pattern is what ExecuTorch's
    quantized embedding kernels replace."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from torchao.quantization import IntxUnpackedToInt8Tensor

        table = self.weight
        if (torch.compiler.is_exporting() or not isinstance(table, IntxUnpackedToInt8Tensor)
                or tuple(table.block_size)[0] != 1):  # a block over several rows: no row is dequantized alone
            return super().forward(ids)
        flat = ids.reshape(-1)
        rows = type(table)(qdata=table.qdata.index_select(0, flat), scale=table.scale.index_select(0, flat),
                           zero_point=table.zero_point.index_select(0, flat), target_dtype=table.target_dtype,
                           block_size=table.block_size, dtype=table.dtype, activation_quantization=None)
        return rows.dequantize().view(*ids.shape, -1)


class DecoderBody(nn.Module):
    """The ``model.`` prefix of a Hugging Face causal LM."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, geometry, mixer, i)
                                    for i, (geometry, mixer) in enumerate(zip(args.layer_geometry, args.layer_mixer)))
        for layer, source in zip(self.layers, args.layer_kv_source):
            if source is not None:
                layer.self_attn.read_cache_of(self.layers[source].self_attn)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.unit_offset_norm, args.norm_weight_fp32)
        if args.per_layer_input:  # Gemma 4's per-layer embeddings: every layer's vector of a token, packed
            width = args.num_hidden_layers * args.per_layer_input
            self.embed_tokens_per_layer = Embedding(args.per_layer_vocab, width)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(args.per_layer_input, args.rms_norm_eps,
                                                     weight_fp32=args.norm_weight_fp32)


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
        self.every_position = False  # forward's default for full_logits (logits_of_every_position)
        self.embeddings_out = False  # forward returns the tokens' embeddings (returns_token_embeddings)
        self.head_ids: torch.Tensor | None = None  # the token of each logit, when lm_head scores a few (score_only)
        # quant.rotation kept the tied embedding unrotated: the residual stream is rotated after the embedding and
        # back before the final norm (exporters.quant.rotation).
        self.embed_rotation: Rotation | None = None
        self.norm_rotation: Rotation | None = None
        if args.tie_word_embeddings:
            self.tie_weights()
        if args.keeps_final_hidden:  # state: [max_context_len, hidden], by position (linear: no ring, no sink)
            self.register_buffer("final_hidden", torch.empty(0), persistent=False)
        for name, _ in args.rope:
            self.register_buffer(f"rope_cos_{name}", torch.empty(0), persistent=False)
            self.register_buffer(f"rope_sin_{name}", torch.empty(0), persistent=False)
            self.register_buffer(f"rope_inv_freq_{name}", torch.empty(0), persistent=False)
        self.register_buffer("cache_positions", torch.empty(0, dtype=torch.int64), persistent=False)
        if args.mrope_axes:
            # State: per cache slot, how far the M-RoPE position of the token after it is from its slot (images
            # take fewer positions than tokens): where the next call continues, shared by every method as the KV
            # cache is, and right after any rewind.
            self.register_buffer("rope_offset", torch.empty(0, dtype=torch.int64), persistent=False)
            # Constant one-hot [3, rot_dim]: which stream each rotary dimension reads.
            self.register_buffer("mrope_select", torch.empty(0), persistent=False)
        self.embed_scale = in_each_dtype(args.embed_scale or 1.0)
        self.per_layer_scale = in_each_dtype(args.per_layer_input**0.5)  # Gemma 4's per-layer table: sqrt(width)
        if self.model.norm.weight.device.type != "meta":
            self.init_buffers()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def score_only(self, ids: torch.Tensor) -> None:
        """From now on ``lm_head`` scores the tokens ``ids`` alone (FR-Spec's draft, models.vocabulary): a matrix of
        their rows (of the embedding's, when tied), not tied to the embedding; logit ``j`` is token ``head_ids[j]``."""
        weight = self.lm_head.weight
        head = nn.Linear(self.args.hidden_size, len(ids), bias=False, device=weight.device, dtype=weight.dtype)
        if weight.device.type != "meta":
            with torch.no_grad():
                head.weight.copy_(weight[ids])
        self.lm_head, self.tied_head = head, False
        self.head_ids = ids

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
            setattr(self, f"rope_inv_freq_{name}", torch.tensor(table.inv_freq, dtype=torch.float32, device=device))
        self.cache_positions = torch.arange(max(g.slots for g in a.layer_geometry), device=device)
        if a.mrope_axes:
            self.rope_offset = torch.zeros(a.max_context_len, dtype=torch.int64, device=device)
            axes = torch.tensor(a.mrope_axes * 2, device=device)  # cos/sin repeat the frequencies twice
            self.mrope_select = (axes[None, :] == torch.arange(3, device=device)[:, None]).float()
        dtype = self.activation_dtype()
        if a.keeps_final_hidden:
            self.final_hidden = torch.zeros(a.max_context_len, a.hidden_size, dtype=dtype, device=device)
        rot_dims = {name: 2 * len(table.inv_freq) for name, table in a.rope}
        for layer, rope in zip(self.model.layers, a.layer_rope):
            if layer.mixer != Mixer.attention:
                layer.recurrent().rebuild(dtype, device)
                continue
            attn = layer.self_attn
            if rope is not None:
                attn.q_rotate = rotate_half_matrix(rot_dims[rope]).to(device)
                attn.k_rotate = rotate_half_matrix(rot_dims[rope]).to(device)
            if not attn.shares_cache:
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
        attentions = [layer.self_attn for layer in self.attention_layers()]
        kept = [attn.kv_cache for attn in attentions]
        device = self.cache_positions.device
        for attn in attentions:
            a = dataclasses.replace(attn.args, kv_dtype=kv_dtype)  # the layer's own head size and kv heads
            attn.kv_cache = attn.cache_layout_of(a)(a.num_key_value_heads, attn.kv_cache.geometry, a.head_dim)
            attn.kv_cache.rebuild(self.activation_dtype(), device)
        try:
            yield
        finally:
            for attn, cache in zip(attentions, kept):
                attn.kv_cache = cache

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings [1, T, hidden] of ``tokens`` [1, T], scaled as the family scales them: what a
        vision-language model's image features stand beside (``text_decoder`` takes either)."""
        h = self.model.embed_tokens(tokens)
        if self.args.embed_scale is not None:  # rounded to the activation dtype first, as transformers does
            h = h * self.embed_scale[h.dtype]
        return h

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """Hidden states [1, T, hidden] before the first layer, of tokens [1, T] or of embeddings [1, T, hidden]."""
        h = inputs if inputs.is_floating_point() else self.token_embeddings(inputs)
        return rotated(self.embed_rotation, h)

    def per_layer_inputs(self, tokens: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor | None]:
        """Each layer's per-layer embedding [1, T, per_layer_input] of ``tokens`` [1, T] whose embeddings are ``h``
        (Gemma 4's PLE: the token's own row and a normed projection of its embedding, averaged by 2^-0.5), or None
        per layer for a model without them."""
        a = self.args
        if not a.per_layer_input:
            return [None] * a.num_hidden_layers
        if tokens.is_floating_point():
            raise ValueError("per-layer embeddings (Gemma 4) are looked up by token id; this model takes embeddings "
                             "only with the ids beside them (DecoderArgs.id_channels)")
        m = self.model
        shape = (1, -1, a.num_hidden_layers, a.per_layer_input)
        own = (m.embed_tokens_per_layer(tokens) * self.per_layer_scale[h.dtype]).view(shape)
        projected = m.per_layer_projection_norm((m.per_layer_model_projection(h) * a.hidden_size**-0.5).view(shape))
        both = (projected + own) * 2.0**-0.5
        return list(both.unbind(dim=2))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The last layer's hidden states [1, T, hidden], normed as the head reads them."""
        return self.model.norm(rotated(self.norm_rotation, h))

    def split_embeddings(self, x: torch.Tensor) -> WideEmbedding:
        """A wide embedding [1, T, embedding_width] as its parts (:class:`WideEmbedding`)."""
        a = self.args
        sizes = [a.hidden_size] * (1 + a.deepstack) + [len(IMAGE_CHANNELS)] * bool(a.mrope_axes)
        parts = list(x.split(sizes + [ID_DIGITS] * a.id_channels, dim=-1))
        ids = ids_of_digits(parts.pop()) if a.id_channels else None
        image = parts.pop()[0] if a.mrope_axes else None
        return WideEmbedding(parts[0], parts[1:], image, ids)

    def text_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """What ``token_embedding`` gives for ``tokens`` [1, T]: their embeddings [1, T, embedding_width], with zeros
        in the deepstack and image channels and, with ``id_channels``, the tokens' ids."""
        h = self.token_embeddings(tokens)
        a = self.args
        zeros = a.embedding_width - a.hidden_size - (ID_DIGITS if a.id_channels else 0)
        parts = [h] + ([h.new_zeros(h.shape[0], h.shape[1], zeros)] if zeros else [])
        parts += [id_digits(tokens, h.dtype)] if a.id_channels else []
        return torch.cat(parts, dim=-1) if len(parts) > 1 else h

    def placeholders_as_pad(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with every image, audio or video token as the pad token: the per-layer table row transformers
        looks up for them (Gemma 4)."""
        for placeholder in self.args.placeholder_ids:
            ids = torch.where(ids == placeholder, self.args.pad_token_id, ids)
        return ids

    def rope_positions(self, positions: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        """M-RoPE's three position streams [3, T] for a call writing cache ``positions`` [T] (``image``: its tokens'
        :data:`IMAGE_CHANNELS` [T, 3], None for text alone), as transformers' ``get_rope_index`` places them: text at
        its slot plus the offset so far on every stream; an image's token at its image's first position on the first
        stream and that plus its row (column) on the others; after an image of h x w positions the offset grows by
        max(h, w) - h * w. The offset after each slot is kept in ``rope_offset``, so calls of any split (text and
        images together or apart, an image over two calls) continue where the slot before left off (0 at slot 0)."""
        start = positions[:1]
        before = self.rope_offset.index_select(0, (start - 1).clamp(min=0))
        base = torch.where(start > 0, before, torch.zeros_like(before))
        if image is None:
            jump = torch.zeros_like(positions)
            offset = base.expand_as(positions)
            streams = (positions + offset).expand(3, -1)
        else:
            meta = image.to(torch.int64)
            is_image = meta[:, 0] > 0
            place, rows, cols = (meta[:, 0] - 1).clamp(min=0), meta[:, 1], meta[:, 2].clamp(min=1)
            area = rows * cols
            jump = torch.where(is_image & (place + 1 == area), torch.maximum(rows, cols) - area, torch.zeros_like(area))
            offset = base + jump.cumsum(0) - jump  # the offset before each token
            first = positions - place + offset  # an image token's image's first position; text's own
            streams = torch.stack([first, first + torch.where(is_image, place // cols, torch.zeros_like(place)),
                                   first + torch.where(is_image, place % cols, torch.zeros_like(place))])
        self.rope_offset.index_copy_(0, positions, offset + jump)
        return streams

    def vision_runs(self, ids: torch.Tensor) -> torch.Tensor:
        """Per token of ``ids`` [1, T], a key of the run of consecutive image (or video) tokens of the call it is in,
        or -1: the runs transformers' ``get_block_sequence_ids_for_mask`` numbers, keyed by how many other tokens come
        before them (equal within a run, different across runs; a shift to find where runs start would fix T)."""
        ids = ids[0]
        vision = torch.zeros_like(ids, dtype=torch.bool)
        for token in self.args.bidirectional_ids:
            vision = vision | (ids == token)
        others_before = torch.cumsum((~vision).to(torch.int64), 0)
        return torch.where(vision, others_before, torch.full_like(others_before, -1))

    def layer_inputs(self, positions: torch.Tensor, dtype: torch.dtype,
                     rope_positions: torch.Tensor | None = None, runs: torch.Tensor | None = None) -> list[LayerInputs]:
        """What each layer takes besides the hidden states, for tokens at ``positions`` [T]: its RoPE (cos, sin),
        its additive mask over its cache's slots, and the slots the tokens go to; computed once per distinct table
        and cache geometry. ``rope_positions``: M-RoPE's streams [3, T] (:meth:`rope_positions`); None: ``positions``
        on every stream (text from the start of the cache: layer-by-layer runs)."""
        a = self.args
        ropes = self.rope_tables(positions, dtype, rope_positions)
        caches = {g: (g.mask(positions, dtype, self.cache_positions[:g.slots]), g.slot_of(positions))
                  for g in dict.fromkeys(a.layer_geometry)}
        both_ways = {}
        if runs is not None:  # a run's tokens see the later ones of the same run too, within the call
            later = positions[None, :] > positions[:, None]
            pairs = (runs[:, None] == runs[None, :]) & (runs[:, None] >= 0) & later
            for g in dict.fromkeys(g for g, b in zip(a.layer_geometry, a.layer_bidirectional) if b):
                mask, slots = caches[g]
                seen = torch.zeros_like(mask).index_copy(1, slots, pairs.to(mask.dtype))
                both_ways[g] = (torch.where(seen > 0, torch.zeros_like(mask), mask), slots)
        return [LayerInputs(ropes[rope], *(both_ways[g] if b and g in both_ways else caches[g]))
                for rope, g, b in zip(a.layer_rope, a.layer_geometry, a.layer_bidirectional)]

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype,
                    rope_positions: torch.Tensor | None = None) -> dict[str | None, Rope]:
        """Each RoPE table's (cos, sin) [T, 1, rot_dim] for tokens at ``positions`` [T] (None: no RoPE), as
        :meth:`layer_inputs` gives the layers; ``rope_positions`` as there."""
        a = self.args
        ropes: dict[str | None, Rope] = {None: None}
        for name, table in a.rope:  # [T, 1, rot_dim]: broadcasts over heads
            if a.mrope_axes:  # each rotary dimension's angle from its stream's position: the table looked up 3x
                streams = positions.expand(3, -1) if rope_positions is None else rope_positions
                select = self.mrope_select[:, None, None, :]  # [3, 1, 1, rot_dim] over [3, T, 1, rot_dim]
                cos = (getattr(self, f"rope_cos_{name}")[streams].unsqueeze(2) * select).sum(0)
                sin = (getattr(self, f"rope_sin_{name}")[streams].unsqueeze(2) * select).sum(0)
                ropes[name] = (cast(cos, dtype), cast(sin, dtype))
                continue
            if a.attention_sink:  # positions outgrow any table: computed as transformers computes them
                freqs = positions.float()[:, None] * getattr(self, f"rope_inv_freq_{name}")[None, :]
                emb = torch.cat((freqs, freqs), dim=-1)
                cos, sin = emb.cos() * table.attention_scaling, emb.sin() * table.attention_scaling
            else:
                cos, sin = getattr(self, f"rope_cos_{name}")[positions], getattr(self, f"rope_sin_{name}")[positions]
            ropes[name] = (cast(cos, dtype).unsqueeze(1), cast(sin, dtype).unsqueeze(1))
        return ropes

    @contextmanager
    def logits_of_every_position(self) -> Iterator[None]:
        """Within this block ``forward`` returns every position's logits [1, T, V] unless told otherwise: how a
        method that needs them (verify) is captured with only the tokens and the position as its inputs."""
        self.every_position = True
        try:
            yield
        finally:
            self.every_position = False

    @contextmanager
    def returns_token_embeddings(self) -> Iterator[None]:
        """Within this block ``forward(tokens)`` returns :meth:`token_embeddings`: how the ``token_embedding`` method
        is captured from the same module (its table is the decoder's, stored once)."""
        self.embeddings_out = True
        try:
            yield
        finally:
            self.embeddings_out = False

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None,
                full_logits: bool | None = None) -> torch.Tensor:
        """Logits of the last token [1, V] (of every position [1, T, V] with ``full_logits``; None: as
        :meth:`logits_of_every_position` says) for ``tokens`` [1, T], or their embeddings [1, T, hidden] (a
        vision-language prompt's), placed at ``input_pos``.."""
        if self.embeddings_out:
            return self.text_embeddings(tokens)
        assert input_pos is not None, "the decoder needs the position of the first token"
        if full_logits is None:
            full_logits = self.every_position
        seq_len = tokens.shape[1]
        call = self.args.max_call_tokens
        if isinstance(seq_len, int) and seq_len > call:  # eager only (a method takes at most `call`): in calls
            # the ring caches can take, each writing before it attends
            out = [self(tokens[:, i:i + call], input_pos + i, full_logits) for i in range(0, seq_len, call)]
            return torch.cat(out, dim=1) if full_logits else out[-1]
        positions = input_pos[0] + torch.arange(seq_len, dtype=torch.int64)
        deep: list[torch.Tensor] = []
        image, ids = None, tokens
        runs = None
        if self.args.wide_embeddings and tokens.is_floating_point():  # a wide embedding: an image's, or text's
            tokens, deep, image, digits = self.split_embeddings(tokens)
            ids = tokens if digits is None else self.placeholders_as_pad(digits)
            if self.args.bidirectional_ids and digits is not None:
                runs = self.vision_runs(digits)
        h = self.embed(tokens)
        per_layer = self.per_layer_inputs(ids, h)
        streams = self.rope_positions(positions, image) if self.args.mrope_axes else None
        layer_inputs = self.layer_inputs(positions, h.dtype, streams, runs)
        for i, (layer, inputs, extra) in enumerate(zip(self.model.layers, layer_inputs, per_layer)):
            h = layer(h, inputs.rope, positions, inputs.mask, inputs.slots, extra)
            if i < len(deep):  # Qwen3-VL: an image's features from vision layer i (zeros for text)
                h = h + deep[i]
        h = self.final_norm(h)
        if self.args.keeps_final_hidden:
            self.final_hidden.index_copy_(0, positions, h[0])
        if not full_logits:  # the last token's hidden state [1, hidden]
            # A view when T is a static 1 (decode), which XNNPACK delegates; it has no select, so a
            # dynamic-length method keeps one portable op here.
            h = h.view(1, -1) if isinstance(seq_len, int) and seq_len == 1 else h[:, -1, :]
        return self.softcap(self.head(h))

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits as the family finishes them: Granite's divisor, Gemma 2/4's soft-capping."""
        if self.args.logits_divisor is not None:
            logits = logits / self.args.logits_divisor
        if self.args.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.args.final_logit_softcap) * self.args.final_logit_softcap
        return logits

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of every position from the last layer's hidden states ``h`` [1, T, hidden] (eager use:
        calibration and sensitivity run the layers one at a time)."""
        return self.softcap(self.head(self.final_norm(h)))

    @torch.no_grad()
    def reset_cache(self) -> None:
        """Zero every KV buffer and recurrent state, so a new sequence starts clean (eager runs: baseline,
        validation)."""
        for layer in self.model.layers:
            if layer.holds_state:
                layer.state()[1].reset()
        if self.args.mrope_axes:
            self.rope_offset.zero_()
        if self.args.keeps_final_hidden:
            self.final_hidden.zero_()

    def attention_layers(self) -> list[DecoderLayer]:
        """The attention layers that keep a KV cache (not those reading another layer's, Gemma 4)."""
        return [layer for layer in self.model.layers if layer.mixer == Mixer.attention and layer.holds_state]

    def kv_caches(self) -> list[KVCache]:
        return [layer.self_attn.kv_cache for layer in self.attention_layers()]

    def recurrent_mixers(self) -> list[ShortConv | GatedDeltaNet]:
        return [layer.recurrent() for layer in self.model.layers if layer.mixer != Mixer.attention]

    def state_buffers(self) -> list[str]:
        """Names of every buffer of the state methods share: the KV caches' (codes, and scales when quantized) and
        the recurrent mixers' (their last inputs, Gated DeltaNet's matrices)."""
        held = [f"model.layers.{i}.{path}.{name}" for i, layer in enumerate(self.model.layers) if layer.holds_state
                for path, state in [layer.state()] for name, _ in state.named_buffers()]
        return (held + (["rope_offset"] if self.args.mrope_axes else [])
                + (["final_hidden"] if self.args.keeps_final_hidden else []))

    def recurrent_state_bytes(self) -> int:
        """Bytes of the state that is not a KV cache (a constant, whatever the context): short convolutions' inputs,
        Gated DeltaNet's inputs and matrices."""
        return sum(mixer.bytes() for mixer in self.recurrent_mixers())

    def parameter_count(self) -> int:
        """Its parameters, a tied matrix once (``parameters()`` yields each tensor once); shapes alone on meta."""
        return sum(p.numel() for p in self.parameters())

    def kv_bytes_per_token(self) -> int:
        """Bytes one position of context takes in the cache, over every layer."""
        return sum(cache.bytes_per_slot() for cache in self.kv_caches())
