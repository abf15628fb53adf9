"""Core ML: Apple's delegate (its multi-method preprocessing merges the methods into one multifunction model), and
coremltools' PT2E quantizer."""

from __future__ import annotations

from typing import Any

import torch

from exporters.backends.backend import Activations, Backend, Pt2eRecipe
from exporters.config import Pt2eQuantizer


def partitioners(options: dict[str, Any]) -> list[Any]:
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


def quantizer(activations: Activations, bits: int) -> Any:
    """coremltools' quantizer: affine uint8 activations (or float ones), symmetric per-channel weights."""
    from coremltools.optimize.torch.quantization.quantization_config import LinearQuantizerConfig, QuantizationScheme
    from executorch.backends.apple.coreml.quantizer import CoreMLQuantizer

    config = LinearQuantizerConfig.from_dict({"global_config": {
        "quantization_scheme": QuantizationScheme.symmetric,
        "activation_dtype": torch.quint8 if activations == "static" else torch.float32,
        "weight_dtype": "qint4" if bits == 4 else torch.qint8,
        "weight_per_channel": True,
    }})
    return CoreMLQuantizer(config)


BACKEND = Backend(name="coreml", partitioner="coreml", partitioners=partitioners, pt2e={
    Pt2eQuantizer.coreml_8a_c8w: Pt2eRecipe("coreml", "static", 8, quantizer, quantized_outputs=False),
    Pt2eQuantizer.coreml_8a_c4w: Pt2eRecipe("coreml", "static", 4, quantizer, quantized_outputs=False),
    Pt2eQuantizer.coreml_c4w: Pt2eRecipe("coreml", "none", 4, quantizer, quantized_outputs=False),
})
