"""The KV cache of one attention layer: which slots hold which positions (:class:`CacheGeometry`), and how keys and
values are stored and attended (:class:`KVCache` for ATen attention, :class:`CustomOpsKVCache` and
:class:`QuantizedKVCache` for ExecuTorch's LLM kernels).

A cache is a fixed number of slots. Position ``p`` goes to slot ``p`` while the cache is linear; a ring (a
sliding-window layer, or every layer of a model with an attention sink) keeps the first ``sink`` positions in their
slots and writes the rest round the remaining slots, so memory stays at the window however long the conversation.
Which position a ring slot holds follows from the last position written (writes are in order), so no bookkeeping
buffer is needed: masks are computed from the call's positions alone, the same way in every method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.casts import cast, fp32


@dataclass(frozen=True)
class CacheGeometry:
    """Slots of one layer's cache and what a query sees: the ``sink`` first positions and the last ``window``.

    ``ring``: positions wrap round the slots after the sink (else slot = position, positions < slots).
    ``window`` None: every earlier position (plain causal attention).
    """

    slots: int
    sink: int = 0
    window: int | None = None
    ring: bool = False

    @staticmethod
    def of(context: int, window: int | None, sink: int, call_tokens: int) -> "CacheGeometry":
        """The smallest geometry serving a layer of ``window`` (None: full attention) in a model with ``context``
        cache positions, an attention ``sink`` (0: none) and calls of up to ``call_tokens`` tokens.

        A call writes all its tokens before attending, so a ring needs ``call_tokens - 1`` slots beyond what its
        queries see: the first query's window must not have been overwritten by the call's last token."""
        headroom = call_tokens - 1
        if sink:  # windowed layers: their window; the others the sink and the last context - sink positions, so
            # the first `context` positions match a plain cache exactly
            if window is not None and window < context - sink:
                return CacheGeometry(window + headroom, 0, window, ring=True)
            return CacheGeometry(context + headroom, sink, context - sink, ring=True)
        if window is not None and window + headroom < context:
            return CacheGeometry(window + headroom, 0, window, ring=True)
        return CacheGeometry(context, 0, window, ring=False)

    @property
    def plain(self) -> bool:
        """Linear and fully causal: ``llama::custom_sdpa``'s own causal path needs no mask."""
        return not self.ring and self.window is None

    def slot_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Slots of ``positions`` [T]."""
        if not self.ring:
            return positions
        ring = self.slots - self.sink
        return torch.where(positions < self.sink, positions, self.sink + (positions - self.sink) % ring)

    def held_positions(self, last: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The position each of a ring's ``slots`` (0..slots-1) holds once ``last`` (0-d) is written; -1: none yet."""
        ring = self.slots - self.sink
        held = last - (last - slots) % ring  # the newest position <= last written to each ring slot
        held = torch.where(slots < self.sink, slots, held)
        valid = (held >= 0) & (held <= last) & ((slots < self.sink) | (held >= self.sink))
        return torch.where(valid, held, -1)

    def mask(self, positions: torch.Tensor, dtype: torch.dtype, slots: torch.Tensor) -> torch.Tensor:
        """Additive mask [T, slots] of queries at ``positions`` [T] (in order) over the slots after their call;
        ``slots``: 0..slots-1 (the model's constant, so the graph holds no arange)."""
        queries = positions[:, None]
        if not self.ring:  # slot = position: query p sees slots s <= p (and with a window only p - w < s)
            held = slots[None, :]
            visible = held <= queries
        else:
            held = self.held_positions(positions[-1], slots)[None, :]
            visible = (held >= 0) & (held <= queries)
        if self.window is not None:
            visible = visible & ((held > queries - self.window) | (held < self.sink))
        return cast(torch.where(visible, 0.0, float("-inf")), dtype)


class KVCache(nn.Module):
    """One layer's cache for ATen attention: ``k_cache`` / ``v_cache`` [1, kv_heads, slots, head_dim].

    The same buffer names in every exported method let the methods share one cache in the runtime; the
    update is ``index_copy_`` at the new tokens' slots (an in-place ``index_put_`` after emit).
    """

    def __init__(self, kv_heads: int, geometry: CacheGeometry, head_dim: int) -> None:
        super().__init__()
        self.geometry = geometry
        shape = self.shape(kv_heads, geometry.slots, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    @staticmethod
    def shape(kv_heads: int, slots: int, head_dim: int) -> tuple[int, ...]:
        return (1, kv_heads, slots, head_dim)

    def cache_dtype(self, activations: torch.dtype) -> torch.dtype:
        return activations

    def update(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, start_pos: Any = None) -> None:
        """Write ``k`` / ``v`` [1, kv_heads, T, head_dim] at ``slots`` [T]."""
        self.k_cache.index_copy_(2, slots, cast(k, self.k_cache.dtype))
        self.v_cache.index_copy_(2, slots, cast(v, self.v_cache.dtype))

    @torch.no_grad()
    def rebuild(self, activations: torch.dtype, device: str | torch.device) -> None:
        """Empty buffers on ``device``: keys and values in the dtype this layout keeps for ``activations``, any
        others (a quantized cache's scales and zero points) in their own."""
        for name, buffer in list(self.named_buffers()):
            dtype = self.cache_dtype(activations) if name in ("k_cache", "v_cache") else buffer.dtype
            setattr(self, name, torch.zeros(buffer.shape, dtype=dtype, device=device))

    @torch.no_grad()
    def reset(self) -> None:
        for buffer in self.buffers():
            buffer.zero_()

    def bytes(self) -> int:
        """Bytes of this layer's cache: keys, values and, when quantized, their scales."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def bytes_per_slot(self) -> int:
        return self.bytes() // self.geometry.slots


class CustomOpsKVCache(KVCache):
    """The cache of ExecuTorch's LLM kernels: [1, slots, kv_heads, head_dim], always fp32 (the kernels take fp32).

    A plain (linear, causal) cache is written by ``llama::update_cache`` from the first new position on and read by
    ``llama::custom_sdpa``'s causal path; a ring or windowed one is written at its slots
    (``llama::update_cache_with_indices``) and read with a mask over every slot."""

    @staticmethod
    def shape(kv_heads: int, slots: int, head_dim: int) -> tuple[int, ...]:
        return (1, slots, kv_heads, head_dim)

    def cache_dtype(self, activations: torch.dtype) -> torch.dtype:
        return torch.float32

    def write(self, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, start_pos: Any) -> None:
        """``value`` [1, T, ...] into ``cache`` from ``start_pos`` on (plain) or at ``slots`` [T] (ring, window)."""
        if self.geometry.ring:
            torch.ops.llama.update_cache_with_indices(value, cache, start_pos, slots[None, :])
        else:
            torch.ops.llama.update_cache(value, cache, start_pos)

    def update(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, start_pos: Any = None) -> None:
        """Write ``k`` / ``v`` [1, T, kv_heads, head_dim]: ``start_pos`` is the first position (a SymInt)."""
        self.write(fp32(k), self.k_cache, slots, start_pos)
        self.write(fp32(v), self.v_cache, slots, start_pos)

    def attend(self, q: torch.Tensor, start_pos: Any, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Attention of ``q`` [1, T, heads, head_dim] -> fp32, same shape: causal from ``start_pos`` over the filled
        slots, or over every slot with ``mask`` [T, slots] (ring, window)."""
        if mask is None:
            return torch.ops.llama.custom_sdpa(fp32(q), self.k_cache, self.v_cache, start_pos, None, 0.0, True, scale)
        return torch.ops.llama.custom_sdpa(fp32(q), self.k_cache, self.v_cache, 0, fp32(mask), 0.0, False, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 codes of ``x`` [..., head_dim] with an fp32 scale and int8 zero point per leading index (asymmetric, as
    ExecuTorch's export_llm quantizes its cache and query for ``llama::custom_quantized_sdpa``)."""
    import executorch.kernels.quantized  # noqa: F401  (the ops' out variants, which emit needs)
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed ops)

    qd = torch.ops.quantized_decomposed
    x = fp32(x)
    scales, zero_points = qd.choose_qparams_per_token_asymmetric.default(x, torch.int8)
    codes = qd.quantize_per_token(x, scales, zero_points, -128, 127, torch.int8)
    return codes, fp32(scales), cast(zero_points, torch.int8)


class QuantizedKVCache(CustomOpsKVCache):
    """An int8 cache for ExecuTorch's LLM kernels: codes [1, slots, kv_heads, head_dim] with one fp32 scale and
    int8 zero point per slot and head ([..., 1]): 4 + 1 bytes per head_dim bytes, 0.27x fp32's at head_dim 64.

    Codes, scales and zero points are written alike; ``llama::custom_quantized_sdpa`` reads them, and takes the
    query quantized per token and head too.
    """

    def __init__(self, kv_heads: int, geometry: CacheGeometry, head_dim: int) -> None:
        super().__init__(kv_heads, geometry, head_dim)
        scales = (1, geometry.slots, kv_heads, 1)
        for side in ("k", "v"):
            self.register_buffer(f"{side}_cache_scales", torch.zeros(scales), persistent=False)
            self.register_buffer(f"{side}_cache_zero_points", torch.zeros(scales, dtype=torch.int8), persistent=False)

    def cache_dtype(self, activations: torch.dtype) -> torch.dtype:
        return torch.int8

    def update(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, start_pos: Any = None) -> None:
        for side, x in (("k", k), ("v", v)):
            codes, scales, zero_points = quantize_per_token(x)
            self.write(codes, getattr(self, f"{side}_cache"), slots, start_pos)
            self.write(scales, getattr(self, f"{side}_cache_scales"), slots, start_pos)
            self.write(zero_points, getattr(self, f"{side}_cache_zero_points"), slots, start_pos)

    def attend(self, q: torch.Tensor, start_pos: Any, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        codes, scales, zero_points = quantize_per_token(q)
        causal = mask is None
        return torch.ops.llama.custom_quantized_sdpa(
            codes, self.k_cache, self.v_cache, start_pos if causal else 0, None if causal else fp32(mask), 0.0,
            causal, scale, zero_points, scales, self.k_cache_zero_points, self.k_cache_scales,
            self.v_cache_zero_points, self.v_cache_scales)


# What the cache of ExecuTorch's LLM kernels stores, by DecoderArgs.kv_dtype.
KV_CACHES: dict[str, type[CustomOpsKVCache]] = {"fp32": CustomOpsKVCache, "int8": QuantizedKVCache}
