"""Quantize: dtype cast and torchao source transforms on the eager model, before capture."""

from __future__ import annotations

from exporters.artifacts import LoadedModel, QuantizedModel
from exporters.config import QuantConfig
from exporters.pipeline import Stage
from exporters.quantization import quantize_model


class QuantizeStage(Stage):
    name = "quantize"

    def __init__(self, quant_cfg: QuantConfig) -> None:
        self.cfg = quant_cfg

    def run(self, loaded: LoadedModel) -> QuantizedModel:
        applied = quantize_model(loaded.model, self.cfg)
        return QuantizedModel(loaded=loaded, quantization=applied)
