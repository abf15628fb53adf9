"""Vulkan: the GPU delegate (static shapes), and its PT2E weight quantizer."""

from __future__ import annotations

from typing import Any

from exporters.backends.backend import Activations, Backend, Pt2eRecipe
from exporters.config import Pt2eQuantizer


def partitioners(options: dict[str, Any]) -> list[Any]:
    from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner

    return [VulkanPartitioner({"require_dynamic_shapes": False, **options})]


def quantizer(activations: Activations, bits: int) -> Any:
    from executorch.backends.vulkan.quantizer.vulkan_quantizer import VulkanQuantizer, get_symmetric_quantization_config

    return VulkanQuantizer().set_global(get_symmetric_quantization_config(is_dynamic=False, weight_bits=bits))


BACKEND = Backend(name="vulkan", partitioner="vulkan", partitioners=partitioners,
                  pt2e={Pt2eQuantizer.vulkan_8w: Pt2eRecipe("vulkan", "none", 8, quantizer)})
