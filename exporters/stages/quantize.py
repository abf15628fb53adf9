"""Quantize: torchao source transforms on the eager model, before capture."""

from __future__ import annotations

from exporters.artifacts import LoadedModel, QuantizedModel
from exporters.config import QuantConfig
from exporters.pipeline import Stage
from exporters.quantization import quantize_linears


class QuantizeStage(Stage):
    name = "quantize"

    def __init__(self, quant_cfg: QuantConfig) -> None:
        self.cfg = quant_cfg

    def run(self, loaded: LoadedModel) -> QuantizedModel:
        applied = quantize_linears(loaded.model, self.cfg.linear, self.cfg.group_size)
        return QuantizedModel(loaded=loaded, quantization=applied)
