"""How a component is quantized: the plan's decision, made once (``exporters.plan.Component.quant``)."""

from __future__ import annotations

from dataclasses import dataclass

from exporters.config import Algorithm, QuantConfig, RotationKind, TiedEmbeddingStorage
from exporters.quant.pt2e import PT2E_QUANTIZERS
from exporters.quant.rotation import rotates


@dataclass(frozen=True)
class QuantPlan:
    """How a component is quantized: the scheme of each layer role (``quant.*``), the tied-embedding storage, and
    whether a calibration text is read."""

    config: QuantConfig
    tied_storage: TiedEmbeddingStorage
    shortcuts: bool = True  # HQQ's scales chosen by blocks of rows (exporters.quant.hqq; torchao's own otherwise)

    @property
    def cast_whole(self) -> bool:
        """The whole model is cast to ``quant.dtype`` before quantizing: calibration runs it, a rotation turns it."""
        return self.calibrated or rotates(self.config)

    @property
    def calibrated(self) -> bool:
        """A calibration text is read: a calibrated algorithm, a size budget, a PT2E quantizer with static
        activations, or a rotation (which looks for massive activations in it)."""
        q = self.config
        computes = bool(q.linear or q.lm_head)
        return ((not Algorithm(q.algorithm).data_free and computes) or (q.size_budget is not None and computes)
                or (q.pt2e is not None and PT2E_QUANTIZERS[q.pt2e].calibrated) or q.rotation != RotationKind.none)
