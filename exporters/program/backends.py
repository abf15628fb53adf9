"""Backend registry: the partitioners each ``conf/backend/*.yaml`` option selects.

A backend is one YAML file plus one factory here; the factory receives only ``backend.options``.
Partitioners are built lazily so importing this module pulls in no backend's dependencies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from exporters.errors import UserError, check_choice

if TYPE_CHECKING:
    from exporters.config import BackendConfig

PartitionerFactory = Callable[[dict[str, Any]], list[Any]]

PARTITIONERS: dict[str, PartitionerFactory] = {}


def register_partitioner(name: str) -> Callable[[PartitionerFactory], PartitionerFactory]:
    def wrap(fn: PartitionerFactory) -> PartitionerFactory:
        PARTITIONERS[name] = fn
        return fn

    return wrap


@register_partitioner("none")
def no_partitioner(options: dict[str, Any]) -> list[Any]:
    """Portable: every op runs on ExecuTorch's portable kernels."""
    return []


@register_partitioner("xnnpack")
def xnnpack_partitioner(options: dict[str, Any]) -> list[Any]:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner(**options)]


@register_partitioner("coreml")
def coreml_partitioner(options: dict[str, Any]) -> list[Any]:
    """Core ML; its multi-method preprocessing merges the methods into one multifunction model."""
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner

    compile_specs = CoreMLBackend.generate_compile_specs(
        minimum_deployment_target=getattr(ct.target, options.get("deployment_target", "iOS18")),
        compute_precision=getattr(ct.precision, options.get("compute_precision", "FLOAT16")),
        compute_unit=getattr(ct.ComputeUnit, options.get("compute_unit", "CPU_ONLY")),
        model_type=CoreMLBackend.MODEL_TYPE.MODEL,
    )
    return [CoreMLPartitioner(
        compile_specs=compile_specs,
        # coremltools cannot convert the KV-cache update (index_put on a buffer); it runs on ExecuTorch's
        # kernels between the delegated blocks, in place on the shared cache.
        skip_ops_for_coreml_delegation=list(options.get("skip_ops", ["aten.index_put.default"])),
        # The KV cache stays an ExecuTorch mutable buffer shared by all methods; a Core ML state
        # would belong to one function of the multifunction model, breaking prefill -> decode.
        take_over_mutable_buffer=bool(options.get("take_over_mutable_buffer", False)),
    )]


@register_partitioner("vulkan")
def vulkan_partitioner(options: dict[str, Any]) -> list[Any]:
    from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner

    return [VulkanPartitioner({"require_dynamic_shapes": False, **options})]


def partitioners(name: str, options: dict[str, Any]) -> list[Any]:
    return PARTITIONERS[name](dict(options))


def check_backend(backend: BackendConfig, bench: bool | None) -> None:
    """The option file names a known partitioner, and a bench is asked for only where the delegate runs."""
    check_choice("backend.partitioner", backend.partitioner, sorted(PARTITIONERS), "Fix the backend option file.")
    if bench and not backend.runs_here:
        raise UserError(
            f"bench=true: backend={backend.name}'s delegate cannot run on this host, so its speed cannot be measured "
            "here. Set bench=false, or run the bench on a device with that backend."
        )
