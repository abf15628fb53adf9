"""OpenVINO: each partition converted by OpenVINO's PyTorch frontend and compiled for ``device``; needs the
``openvino`` extra, and its device picks the precision it computes in."""

from __future__ import annotations

from typing import Any

from exporters.backends.backend import Backend, BackendExtra
from exporters.program.versions import EXECUTORCH


def partitioners(options: dict[str, Any]) -> list[Any]:
    """The compiled blob does not keep compile-time properties (INFERENCE_PRECISION_HINT): the runtime imports it with
    the device's defaults, bf16 on CPUs with AMX/AVX512-BF16."""
    from executorch.backends.openvino.partitioner import OpenvinoPartitioner
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    return [OpenvinoPartitioner(compile_spec=[CompileSpec("device", str(options.get("device", "CPU")).encode())])]


def precision(options: dict[str, Any]) -> str:
    """What the device computes in on this host: OpenVINO's CPU plugin picks bf16 on CPUs with AMX or AVX512-BF16
    (fp32 elsewhere, f16 on its GPUs), whatever the program's dtype."""
    import openvino as ov

    hint = ov.Core().get_property(str(options.get("device", "CPU")), "INFERENCE_PRECISION_HINT")
    return {ov.Type.f32: "fp32", ov.Type.f16: "fp16", ov.Type.bf16: "bf16"}[hint]


PACKED_ONCE = (
    "Never shared: each method's OpenVINO blob holds its own copy of the weights (in the file and in memory). "
    "The runtime needs ExecuTorch's OpenVINO backend and openvino 2025.x's libopenvino_c.so (found from the "
    "openvino Python package, or OPENVINO_LIB_PATH); the device picks the precision it computes in (bf16 on "
    "CPUs with AMX or AVX512-BF16).")

BACKEND = Backend(name="openvino", partitioner="openvino", partitioners=partitioners, precision=precision,
                  packed_once=PACKED_ONCE, extra=BackendExtra(
                      "openvino", {"openvino": "2025.", "nncf": "3."}, "OpenvinoBackend",
                      f"ExecuTorch {EXECUTORCH}'s OpenVINO runtime is built against the 2025 C API (openvino 2026 "
                      "crashes when a method runs), and its partitioner's package imports nncf"))
