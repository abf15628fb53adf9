"""Quantize: dtype cast and torchao source transforms on the eager model, before capture."""

from __future__ import annotations

from exporters.stages.artifacts import LoadedModel, QuantizedModel
from exporters.config import QuantConfig
from exporters.stages.pipeline import Stage
from exporters.quant.schemes import quantize_model


class QuantizeStage(Stage):
    name = "quantize"

    def __init__(self, quant_cfg: QuantConfig, tied_embedding: str = "shared") -> None:
        self.cfg = quant_cfg
        self.tied_embedding = tied_embedding

    def run(self, loaded: LoadedModel) -> QuantizedModel:
        applied = quantize_model(loaded.model, self.cfg)
        if getattr(loaded.model, "tied_head", False):
            if self.tied_embedding == "copied":
                loaded.model.tied_head = False
            applied.notes.append("tied embedding stored once, lm_head reads it" if loaded.model.tied_head else
                                 "tied embedding copied for lm_head (export.tied_embedding=copied)")
        return QuantizedModel(loaded=loaded, quantization=applied)
