"""The KV cache a program keeps: how many positions (``export.max_context_len``), what it stores
(``export.kv_dtype``), which backends can hold it, and what it costs (the manifest's ``kv_cache``).

The cache itself is :mod:`models.decoder`'s (``KVCache`` and its layouts); this module owns the export's choices
about it, checked before any work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from exporters.config import Attention, DType, KvDType
from exporters.errors import UserError
from exporters.manifest import KvCacheEntry
from models.decoder import CausalLM

if TYPE_CHECKING:
    from exporters.config import BackendConfig, ExportSection, QuantConfig
    from exporters.program.lengths import Lengths


def check_kv_cache(ex: ExportSection, backend: BackendConfig, quant: QuantConfig, lengths: Lengths) -> None:
    """A quantized cache needs ExecuTorch's LLM kernels (``llama::custom_quantized_sdpa``), which only backends with
    ``attention: custom_ops`` put in their programs; an attention sink needs room for a window beside it."""
    check_attention_sink(ex, backend, lengths)
    if ex.kv_dtype == KvDType.fp32:
        return
    if backend.attention != Attention.custom_ops:
        raise UserError(
            f"export.kv_dtype={ex.kv_dtype} needs ExecuTorch's quantized-cache attention kernel "
            f"(llama::custom_quantized_sdpa), which backend={backend.name} programs do not use (they attend with "
            "ATen ops the delegate takes). Use backend=xnnpack or backend=portable, or export.kv_dtype=fp32."
        )
    if quant.pt2e is not None:
        raise UserError(
            f"export.kv_dtype={ex.kv_dtype} with quant.pt2e={quant.pt2e}: a quantized KV cache under a PT2E "
            "quantizer is not validated yet. Use export.kv_dtype=fp32, or a torchao scheme (quant=8da4w, 8da8w, ...)."
        )


def check_attention_sink(ex: ExportSection, backend: BackendConfig, lengths: Lengths) -> None:
    sink = ex.attention_sink
    if sink == 0:
        return
    context, call = lengths.context, lengths.call_tokens
    if not backend.dynamic_shapes:
        raise UserError(
            f"export.attention_sink={sink} with backend={backend.name}: a ring-buffer cache has not been validated on "
            "static-shape backends. Use backend=xnnpack or backend=portable, or export.attention_sink=0."
        )
    if sink < 0 or sink + call >= context:
        raise UserError(
            f"export.attention_sink={sink} does not fit a cache of export.max_context_len={context} positions with calls "
            f"of up to {call} tokens (export.max_seq_len): the sink and one call must leave a window, so use "
            f"0 < attention_sink < {context - call}, a larger export.max_context_len, or a smaller export.max_seq_len "
            "(attention_sink=0 turns it off)."
        )


def kv_cache_entry(model: CausalLM, tokens_per_call: int) -> KvCacheEntry:
    """What the program's cache holds and costs, read from the model it was captured from."""
    a = model.args
    caches = model.kv_caches()
    # A float cache (kv_dtype fp32) keeps keys and values in the activations' dtype: fp16 under quant.dtype=fp16.
    stored = caches[0].k_cache.dtype if caches else None
    dtype = next((str(d) for d in DType if d.torch_dtype == stored), str(a.kv_dtype)) if a.kv_dtype == "fp32" \
        else str(a.kv_dtype)
    return KvCacheEntry(positions=a.max_context_len, tokens_per_call=tokens_per_call, dtype=dtype,
                        bytes_per_token=sum(c.bytes_per_slot() for c in caches), bytes=sum(c.bytes() for c in caches),
                        windows=list(a.layer_window), attention_sink=a.attention_sink,
                        slots=[c.geometry.slots for c in caches], layers=[m.value for m in a.layer_mixer],
                        state_bytes=model.recurrent_state_bytes(),
                        cache_of=list(a.layer_kv_source) if any(j is not None for j in a.layer_kv_source) else [])
