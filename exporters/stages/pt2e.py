"""PT2E: the backend's own quantizer on the captured prompt graph (``quant.pt2e``), between quantize and capture.

The quantize stage has cast the dtype (and quantized the embedding if ``quant.embedding`` says so); this stage
captures the model once, has the backend's quantizer annotate, calibrate and convert it
(``exporters.quant.pt2e``), and hands capture the converted module, from which every method is exported.
"""

from __future__ import annotations

from exporters.components.language_model import read_calibration
from exporters.context import ExportContext
from exporters.context.artifacts import EagerModel
from exporters.program.methods import MethodSpec
from exporters.quant.pt2e import PT2E_QUANTIZERS, quantize_graph, reference_graph
from exporters.stages.pipeline import Stage


class Pt2eStage(Stage):
    name = "pt2e"
    after = ("quantize",)

    def run(self, quantized: EagerModel, ctx: ExportContext) -> EagerModel:
        model, component = quantized.model, self.plan.main
        quant = component.quant.config
        assert quant.pt2e is not None
        # The graph calibrated is the prompt method with any number of tokens: it takes the single tokens of
        # decode too, so one calibration serves every method (on static-shape backends as well).
        prompt = MethodSpec("prefill", 1, self.plan.lengths.call_tokens, True)
        text = (read_calibration(quant.calibration, component.build.source, model, ctx.checkpoint)
                if PT2E_QUANTIZERS[quant.pt2e].calibrated else None)
        graph, record = quantize_graph(model, prompt, quant.pt2e, text)
        ctx.pt2e = record
        # The copy validation runs (exporters.quant.pt2e.reference_graph), only with validation.
        return EagerModel(model, quantized=True, graph=graph,
                          reference_graph=reference_graph(graph) if self.plan.validation else None)

    def describe(self, quantized: EagerModel, ctx: ExportContext) -> str:
        assert ctx.pt2e is not None
        return ctx.pt2e.describe()
