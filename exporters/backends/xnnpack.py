"""XNNPACK: the CPU delegate of phones and laptops, and its own PT2E quantizer.

Its private-internal shortcuts (preprocessing one partition at a time, passes only where they apply, weights named by
tensor for a data file) are in ``exporters.program.internals``, each with its stock path.
"""

from __future__ import annotations

from typing import Any

import torch

from exporters.backends.backend import Activations, Backend, Pt2eRecipe
from exporters.config import Pt2eQuantizer


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


BACKEND = Backend(partitioner="xnnpack", partitioners=partitioners, pt2e={
    Pt2eQuantizer.xnnpack_dynamic: Pt2eRecipe("xnnpack", "dynamic", 8, quantizer),
    Pt2eQuantizer.xnnpack_dynamic_qc4: Pt2eRecipe("xnnpack", "dynamic", 4, quantizer),
    Pt2eQuantizer.xnnpack_static: Pt2eRecipe("xnnpack", "static", 8, quantizer),
})
