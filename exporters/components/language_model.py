"""What the decoder and a draft share as kinds: token ids in, logits out, a KV cache, scored on text.

Both are built by ``ModelBuild`` from a checkpoint of their own, estimated from their shapes before a weight is read,
scored unquantized on the validation windows, quantized by ``quant.*`` (a draft: ``draft.quant``) and validated
on the same windows. :class:`LanguageModel` implements those hooks once; ``decoder`` and ``draft`` add their own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from exporters.components.hybrid import check_hybrid
from exporters.components.kind import Kind, Part
from exporters.config import CalibrationConfig, KvDType, ModelConfig, Source
from exporters.plan.footprint import GB, Footprint, MemoryBudget, check_conversion, conversion_peak
from exporters.quant.apply import quantize_model
from exporters.quant.calibration import CalibrationText, calibration_text, check_layer_by_layer
from exporters.quant.distill import check_distillable
from exporters.quant.rotation import check_rotation
from exporters.runtime.quality import TextWindows, full_sequence, window_logits
from models.checkpoint import stored_bytes
from models.decoder import CausalLM
from models.gguf import GgufTensors, pending_conversion
from models.tiny import CORPUS

if TYPE_CHECKING:
    import torch

    from exporters.context import ExportContext
    from exporters.manifest import AppliedQuantization, ValidationReport
    from models.checkpoint import Checkpoint

log = logging.getLogger("exporters")

#: A tiny model knows only the text it was trained on: repeated to the least calibration needs.
TINY_REPEATS = 4


@dataclass
class ModelRecord:
    """What the stages learn of a language model."""

    checkpoint: Checkpoint  # load
    parameters: int  # from its shapes, before any weight is read
    quantization: AppliedQuantization | None = None  # quantize
    validation: ValidationReport | None = None  # validate
    nll: float | None = None  # baseline: unquantized, on the validation windows
    scored: int | None = None  # baseline: the targets ``nll`` is over (fewer when its head scores a few tokens)
    # baseline: the unquantized model's predictions per window [L - P, V], which validation compares the program with
    # too (what the export costs against the model as loaded, not only against its quantized eager model).
    unquantized: list[torch.Tensor] | None = None


def first_conversion(model: ModelConfig) -> GgufTensors | None:
    """The GGUF file ``model.checkpoint`` names when opening it converts it (not cached yet); else None."""
    if model.source != Source.hf or model.checkpoint is None:
        return None
    return pending_conversion(model.checkpoint)


def read_calibration(cfg: CalibrationConfig, source: Source, model: CausalLM, checkpoint: Checkpoint
                     ) -> CalibrationText:
    """The calibration text in windows the model's cache holds. A tiny model only knows the text it was trained on
    (as in validation, exporters.stages.baseline): about 240 tokens, repeated to the minimum calibration needs."""
    own_text = "\n".join([CORPUS] * TINY_REPEATS) if source == Source.tiny and cfg.text_file is None else None
    return calibration_text(cfg, own_text, checkpoint, model.args.vocab_size, model.args.max_context_len)


def unquantized_nll(model: CausalLM, windows: TextWindows) -> tuple[float, int, list[torch.Tensor]]:
    """The model's negative log-likelihood on the validation ``windows``, with an fp32 cache, the targets it is
    over (those its head scores), and its predictions per window."""
    with model.kv_dtype_as(KvDType.fp32):
        logits = window_logits(full_sequence(model), windows)
    model.reset_cache()
    return windows.nll(logits, model.head_ids), windows.scored(model.head_ids), logits


class LanguageModel(Kind):
    """The hooks the decoder and a draft share."""

    def open(self, part: Part, ctx: ExportContext) -> Footprint:
        build, component = part.component.build, part.component
        converting = first_conversion(build.model)
        if converting is not None:  # refused before it starts if the conversion alone cannot fit
            check_conversion(converting, ctx.plan.memory_limit_gb)
            log.info("  load: %s is converted on its first use (about %.1f GB at the peak, estimated)",
                     converting.file.name, conversion_peak(converting) / GB)
        checkpoint = build.checkpoint(ctx.output_dir)
        shapes = build.build(checkpoint, device="meta")
        check_rotation(shapes, component.quant.config)
        check_layer_by_layer(shapes, component.quant.config)
        check_distillable(shapes, component.quant.config)
        check_hybrid(shapes, ctx.plan, component)
        ctx.records[part.name] = ModelRecord(checkpoint, shapes.parameter_count())
        footprint = MemoryBudget.of(ctx.plan, component).estimate(shapes, stored_bytes(checkpoint, shapes))
        return footprint if converting is None else footprint.first_converting(converting)

    def load(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        models[part.name] = part.component.build.build(ctx.record(part.name).checkpoint)

    def quantize(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        model, quant, record = models[part.name], part.component.quant, ctx.record(part.name)
        source = part.component.build.source
        record.quantization = quantize_model(
            model, quant.config, quant.tied_storage,
            lambda: read_calibration(quant.config.calibration, source, model, record.checkpoint), quant.shortcuts)
