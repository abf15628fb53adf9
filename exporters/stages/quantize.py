"""Quantize: dtype cast and torchao source transforms on the eager model, before capture.

The model is quantized in place (``exporters.quant.apply``): a copy would double the peak memory. The
artifact this stage returns is a new one that says so; the one it was handed is not used again.
"""

from __future__ import annotations

from exporters.config import QuantConfig, TiedEmbeddingStorage
from exporters.quant.apply import quantize_model
from exporters.stages.artifacts import EagerModel
from exporters.stages.pipeline import ExportContext, Stage


class QuantizeStage(Stage):
    name = "quantize"
    after = ("load",)

    def __init__(self, quant_cfg: QuantConfig, tied_embedding: TiedEmbeddingStorage) -> None:
        self.cfg = quant_cfg
        self.tied_embedding = tied_embedding

    def run(self, loaded: EagerModel, ctx: ExportContext) -> EagerModel:
        ctx.quantization = quantize_model(loaded.model, self.cfg, self.tied_embedding)
        return EagerModel(loaded.model, quantized=True)

    def describe(self, quantized: EagerModel, ctx: ExportContext) -> str:
        assert ctx.quantization is not None
        return ctx.quantization.describe()
