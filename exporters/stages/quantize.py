"""Quantize: dtype cast and torchao source transforms on the eager models, before capture.

Each part quantizes its own model in place, in registry order (``exporters.components``: the decoder first, whose
dtype the others' outputs must match): a copy would double the peak memory. The artifact this stage returns is a new one that says so; the one it was handed is
not used again. A calibrated ``quant.algorithm`` reads its text here, after loading gave the tokenizer.
"""

from __future__ import annotations

from exporters.components import parts
from exporters.context import ExportContext
from exporters.context.artifacts import EagerModel
from exporters.stages.pipeline import Stage


class QuantizeStage(Stage):
    name = "quantize"
    after = ("load",)

    def run(self, loaded: EagerModel, ctx: ExportContext) -> EagerModel:
        models = self.models_of(loaded)
        for part in parts(self.plan):
            part.kind.quantize(part, ctx, models)
        return EagerModel(loaded.model, quantized=True, components=loaded.components)

    def describe(self, quantized: EagerModel, ctx: ExportContext) -> str:
        models = self.models_of(quantized)
        return "".join(part.kind.describe("quantize", part, ctx, models) for part in parts(self.plan))
