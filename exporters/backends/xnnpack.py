"""XNNPACK: the CPU delegate of phones and laptops, and its own PT2E quantizer.

What is true of it beside ``conf/backend/xnnpack.yaml``: its partitioner and quantizers, the shortcuts lowering takes
through its private internals (preprocessing one partition at a time, passes only where their ops are, weights named
by tensor for a data file; the code is in ``exporters.program.internals`` with the others, each with its stock path),
what a runtime needs to pack its weights once, and that swapped adapters run on it.
"""

from __future__ import annotations

from typing import Any

import torch

from exporters.backends.backend import Activations, Backend, Pt2eRecipe
from exporters.config import Pt2eQuantizer
from exporters.program.internals import (xnnpack_keys_by_name, xnnpack_passes_only_where_they_apply,
                                         xnnpack_preprocess_copies_one_at_a_time)

PACKED_ONCE = (
    "XNNPACK packs weights at load. Turn on its weight cache before loading methods: the runtime option "
    "weight_cache_enabled=true of backend XnnpackBackend (C++: executorch::runtime::set_option, or per load "
    "in a LoadBackendOptionsMap), or build the runtime with EXECUTORCH_XNNPACK_ENABLE_WEIGHT_CACHE=ON "
    "(ExecuTorch's Android and Apple presets do; the pip wheel does not). Without it every loaded method packs "
    "its own copy: bench.rss_after_load_mb (cache on) against bench.rss_after_load_without_weight_cache_mb "
    "(off), when the bench ran. Our tools turn it on.")


def partitioners(options: dict[str, Any]) -> list[Any]:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner(**options)]


def quantizer(activations: Activations, bits: int) -> Any:
    """XNNPACK's quantizer: symmetric per-channel weights of ``bits``, int8 activations (static or per token)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (XNNPACKQuantizer,
                                                                         get_symmetric_quantization_config)

    limit = 1 << (bits - 1)
    weight_range = {"weight_qmin": -limit, "weight_qmax": limit - 1} if bits < 8 else {}
    config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=activations == "dynamic",
                                               **weight_range)
    return XNNPACKQuantizer().set_operator_type(torch.ops.aten.linear.default, config)


BACKEND = Backend(
    name="xnnpack", partitioner="xnnpack", partitioners=partitioners, pt2e={
        Pt2eQuantizer.xnnpack_dynamic: Pt2eRecipe("xnnpack", "dynamic", 8, quantizer),
        Pt2eQuantizer.xnnpack_dynamic_qc4: Pt2eRecipe("xnnpack", "dynamic", 4, quantizer),
        Pt2eQuantizer.xnnpack_static: Pt2eRecipe("xnnpack", "static", 8, quantizer),
    },
    lowering_shortcuts=(xnnpack_preprocess_copies_one_at_a_time, xnnpack_passes_only_where_they_apply),
    weights_by_name=xnnpack_keys_by_name, packed_once=PACKED_ONCE, swaps_adapters=True)
