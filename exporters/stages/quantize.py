"""Quantize: dtype cast and torchao source transforms on the eager model, before capture.

The model is quantized in place (``exporters.quant.apply``): a copy would double the peak memory. The
artifact this stage returns is a new one that says so; the one it was handed is not used again. A calibrated
``quant.algorithm`` reads its text here (``exporters.quant.calibration``), after loading gave the tokenizer.
"""

from __future__ import annotations

from exporters.config import CalibrationConfig, Source
from exporters.program.vision import quantize_vision, vision_scheme
from exporters.quant.apply import quantize_model
from exporters.quant.calibration import CalibrationText, calibration_text
from exporters.stages.artifacts import EagerModel
from exporters.stages.pipeline import ExportContext, Stage
from models.decoder import CausalLM
from models.tiny import CORPUS

TINY_REPEATS = 4


def read_calibration(cfg: CalibrationConfig, source: Source, model: CausalLM, ctx: ExportContext) -> CalibrationText:
    """The calibration text in windows the model's cache holds. A tiny model only knows the text it was trained on
    (as in validation, exporters.stages.baseline): about 240 tokens, repeated to the minimum calibration needs."""
    own_text = "\n".join([CORPUS] * TINY_REPEATS) if source == Source.tiny and cfg.text_file is None else None
    assert ctx.checkpoint is not None
    return calibration_text(cfg, own_text, ctx.checkpoint, model.args.vocab_size, model.args.max_context_len)


class QuantizeStage(Stage):
    name = "quantize"
    after = ("load",)

    def run(self, loaded: EagerModel, ctx: ExportContext) -> EagerModel:
        models = {"decoder": loaded.model, **loaded.components}
        for component in self.plan.language_models:
            model, quant = models[component.name], component.quant
            applied = quantize_model(
                model, quant.config, quant.tied_storage,
                lambda: read_calibration(quant.config.calibration, component.build.source, model, ctx), quant.shortcuts)
            if component.is_decoder:
                ctx.quantization = applied
            else:
                ctx.component_quantization[component.name] = applied
        vision = self.plan.vision
        if vision is not None:  # after the decoder: its output must be in the dtype the decoder now computes in
            quant = vision.quant.config
            ctx.vision_quantization = quantize_vision(models[vision.name], vision_scheme(quant), quant.group_size,
                                                      loaded.model.activation_dtype())
        return EagerModel(loaded.model, quantized=True, components=loaded.components)

    def describe(self, quantized: EagerModel, ctx: ExportContext) -> str:
        assert ctx.quantization is not None
        return ctx.quantization.describe() + "".join(f"; {name}: {q.describe()}"
                                                     for name, q in ctx.component_quantization.items()) + (
            f"; vision encoder: {ctx.vision_quantization}" if ctx.vision_quantization else "")
