"""What learning quantization parameters by gradient needs of the model (``quant.algorithm=signround``,
``distill``): straight-through rounding, and an attention autograd can pass through.

ExecuTorch's ``llama::custom_sdpa`` has no autograd formula: learning through it would give q, k and v no gradient
at all (autograd only warns). :func:`differentiable_attention` swaps a layer's attention for the ATen one around the
same projection modules for the time learning runs.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterable, Iterator

import torch

from models.decoder import Attention, DecoderLayer
from models.kv_cache import KVCache


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward (the straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


def bf16_ste(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16 (as XNNPACK stores blockwise scales) forward, identity backward."""
    return x + (x.to(torch.bfloat16).float() - x).detach()


class _CacheOutOfPlace(KVCache):
    """A cache written out of place: a window longer than one call writes it again after the first call's attention
    read it, which autograd (holding what was read) refuses in place."""

    def update(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, start_pos: object = None) -> None:
        self.k_cache = self.k_cache.index_copy(2, slots, k.to(self.k_cache.dtype))
        self.v_cache = self.v_cache.index_copy(2, slots, v.to(self.v_cache.dtype))


class _LearningAttention(Attention):
    @staticmethod
    def cache_layout_of(args: object) -> type[KVCache]:
        return _CacheOutOfPlace


@contextmanager
def differentiable_attention(layer: DecoderLayer, dtype: torch.dtype) -> Iterator[None]:
    """Within this block ``layer``'s attention runs on ATen ops: the same projections and norms, a cache of its own,
    written out of place."""
    attn = getattr(layer, "self_attn", None)
    if not isinstance(attn, Attention):
        yield
        return
    with torch.device("meta"):
        aten = _LearningAttention(attn.args, attn.kv_cache.geometry, attn.layer)
    for name, child in attn.named_children():
        if name != "kv_cache":
            setattr(aten, name, child)
    aten.q_rotate, aten.k_rotate = attn.q_rotate, attn.k_rotate
    aten.kv_cache.rebuild(dtype, attn.q_rotate.device)
    layer.self_attn = aten
    try:
        yield
    finally:
        layer.self_attn = attn


@contextmanager
def every_attention_differentiable(layers: Iterable[DecoderLayer], dtype: torch.dtype) -> Iterator[None]:
    """:func:`differentiable_attention` for every layer of a model at once (learning through the whole model)."""
    with ExitStack() as stack:
        for layer in layers:
            stack.enter_context(differentiable_attention(layer, dtype))
        yield


def detach_buffers(module: torch.nn.Module) -> None:
    """The caches the last step wrote are not part of the next step's graph."""
    for buffer in module.buffers():
        buffer.detach_()
