"""Backend registry: the partitioners each ``conf/backend/*.yaml`` option selects.

A backend is one YAML file plus one factory here; the factory receives only ``backend.options``.
Partitioners are built lazily so importing this module pulls in no backend's dependencies. A backend that
needs packages beyond the base install names them in :data:`EXTRAS` (checked before an export starts, and
when a program that uses the delegate fails to load); one whose device picks its own compute precision says
how to read it in :data:`RUNTIME_PRECISION` (validation then allows that precision's deviation).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from exporters.config import DType
from exporters.errors import UserError, check_choice, listed
from exporters.program.contents import delegate_ids
from exporters.program.versions import EXECUTORCH

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


@register_partitioner("openvino")
def openvino_partitioner(options: dict[str, Any]) -> list[Any]:
    """OpenVINO: each partition is converted by OpenVINO's PyTorch frontend and compiled for ``device``.

    The compiled blob does not keep compile-time properties (INFERENCE_PRECISION_HINT): the runtime imports
    it with the device's defaults, bf16 on CPUs with AMX/AVX512-BF16.
    """
    from executorch.backends.openvino.partitioner import OpenvinoPartitioner
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    return [OpenvinoPartitioner(compile_spec=[CompileSpec("device", str(options.get("device", "CPU")).encode())])]


@dataclass(frozen=True)
class BackendExtra:
    """Packages a backend needs beyond the base install: its ``pyproject.toml`` extra and the versions that work."""

    extra: str
    versions: dict[str, str]  # distribution -> the version prefix that works with the pinned ExecuTorch
    delegate_id: str  # the backend id its programs carry (how a program's needs are found at load)
    why: str

    def missing(self) -> list[str]:
        """Each required distribution that is absent or of a version that does not work, with what was found."""
        found = []
        for dist, prefix in self.versions.items():
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                found.append(f"{dist} (not installed)")
                continue
            if not version.startswith(prefix):
                found.append(f"{dist} {version} (needs {prefix}x)")
        return found

    @property
    def install(self) -> str:
        return f"Install the extra: pip install -e \".[{self.extra}]\" (from the checkout)"

    def check(self, backend: str) -> None:
        missing = self.missing()
        if missing:
            raise UserError(f"backend={backend} needs {listed(missing)}: {self.why}. {self.install}. "
                            "Nothing was exported.")


EXTRAS: dict[str, BackendExtra] = {
    "openvino": BackendExtra(
        "openvino", {"openvino": "2025.", "nncf": "3."}, "OpenvinoBackend",
        f"ExecuTorch {EXECUTORCH}'s OpenVINO runtime is built against the 2025 C API (openvino 2026 crashes when a "
        "method runs), and its partitioner's package imports nncf"),
}


def _openvino_precision(options: dict[str, Any]) -> str:
    import openvino as ov

    hint = ov.Core().get_property(str(options.get("device", "CPU")), "INFERENCE_PRECISION_HINT")
    return {ov.Type.f32: "fp32", ov.Type.f16: "fp16", ov.Type.bf16: "bf16"}[hint]


# Backends whose device chooses the precision it computes in when a program is loaded (whatever the program's
# dtype), and how to read that choice on this host. OpenVINO's CPU plugin computes in bf16 on CPUs with AMX or
# AVX512-BF16 (fp32 elsewhere, f16 on its GPUs); a compiled blob does not keep the compile-time
# INFERENCE_PRECISION_HINT (ExecuTorch's runtime imports it with the device's defaults).
RUNTIME_PRECISION: dict[str, Callable[[dict[str, Any]], str]] = {"openvino": _openvino_precision}


def runtime_precision(backend: BackendConfig) -> DType | None:
    """The dtype the delegate computes in on this host when the device picks it, else None (the program's)."""

    read = RUNTIME_PRECISION.get(backend.partitioner)
    return DType(read(dict(backend.options))) if read and backend.runs_here else None


def check_loadable(path: Any, error: Exception) -> None:
    """After a method of ``path`` failed to load: if a delegate it uses lacks its packages, say which and how to
    install them (the runtime itself reports only an error code)."""

    used = delegate_ids(path)
    for name, extra in EXTRAS.items():
        missing = extra.missing() if extra.delegate_id in used else []
        if missing:
            raise UserError(
                f"{path} runs on {extra.delegate_id}, which needs {listed(missing)} in this environment: "
                f"{extra.why}. {extra.install}; ExecuTorch said: {error}") from error


def partitioners(name: str, options: dict[str, Any]) -> list[Any]:
    return PARTITIONERS[name](dict(options))


def check_backend(backend: BackendConfig, bench: bool | None) -> None:
    """The option file names a known partitioner, and a bench is asked for only where the delegate runs."""
    check_choice("backend.partitioner", backend.partitioner, sorted(PARTITIONERS), "Fix the backend option file.")
    if backend.partitioner in EXTRAS:
        EXTRAS[backend.partitioner].check(backend.name)
    if bench and not backend.runs_here:
        raise UserError(
            f"bench=true: backend={backend.name}'s delegate cannot run on this host, so its speed cannot be measured "
            "here. Set bench=false, or run the bench on a device with that backend."
        )
