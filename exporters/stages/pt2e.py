"""PT2E: the backend's own quantizer on the captured prompt graph (``quant.pt2e``), between quantize and capture.

The quantize stage has cast the dtype (and quantized the embedding if ``quant.embedding`` says so); this stage
captures the model once, has the backend's quantizer annotate, calibrate and convert it
(``exporters.quant.pt2e``), and hands capture the converted module, from which every method is exported.
"""

from __future__ import annotations

from exporters.config import QuantConfig, Source
from exporters.program.methods import METHOD_KINDS
from exporters.quant.pt2e import PT2E_QUANTIZERS, quantize_graph, reference_graph
from exporters.stages.artifacts import EagerModel
from exporters.stages.pipeline import ExportContext, Stage
from exporters.stages.quantize import read_calibration


class Pt2eStage(Stage):
    name = "pt2e"
    after = ("quantize",)

    def __init__(self, quant_cfg: QuantConfig, max_tokens: int, source: Source, reference: bool = True) -> None:
        """``max_tokens``: most tokens one call of the prompt method takes. ``reference``: also make the copy
        validation runs (exporters.quant.pt2e.reference_graph) (only with validation)."""
        assert quant_cfg.pt2e is not None
        self.cfg = quant_cfg
        self.quantizer = quant_cfg.pt2e
        self.max_tokens = max_tokens
        self.source = source
        self.reference = reference

    def run(self, quantized: EagerModel, ctx: ExportContext) -> EagerModel:
        model = quantized.model
        # The graph calibrated is the prompt method with any number of tokens: it takes the single tokens of
        # decode too, so one calibration serves every method (on static-shape backends as well).
        prompt = METHOD_KINDS["prefill"](self.max_tokens, True, 1)
        text = (read_calibration(self.cfg.calibration, self.source, model, ctx)
                if PT2E_QUANTIZERS[self.quantizer].calibrated else None)
        graph, record = quantize_graph(model, prompt, self.quantizer, text)
        assert ctx.quantization is not None
        ctx.quantization.pt2e = record
        return EagerModel(model, quantized=True, graph=graph,
                          reference_graph=reference_graph(graph) if self.reference else None)

    def describe(self, quantized: EagerModel, ctx: ExportContext) -> str:
        assert ctx.quantization is not None and ctx.quantization.pt2e is not None
        return ctx.quantization.pt2e.describe()
