"""Baseline: score the unquantized model on the validation text, before quantization changes it.

Cuts the validation text into the windows validation will drive the program over, and records the
unquantized model's negative log-likelihood on them: the perplexity quality loss is measured against (and, for a
vision-language checkpoint, its logits on the image prompt validation gives the program).
Runs only with validation on.
"""

from __future__ import annotations

from exporters.config import KvDType, Source, ValidationConfig
from exporters.quant.schemes import DTYPES
from exporters.runtime.quality import full_sequence, make_windows, read_text, text_ids, window_logits
from exporters.stages.artifacts import BaselineQuality, EagerModel
from exporters.stages.pipeline import ExportContext, Stage
from exporters.stages.vision_check import unquantized_image_path
from models.lora import active_adapter
from models.tiny import CORPUS


def validation_text(cfg: ValidationConfig, source: Source) -> tuple[str, str]:
    """The text to score and where it came from: ``validation.text_file``; else, for a tiny model, the text
    it was trained on (scored on English it never saw, its perplexity would mean nothing); else the shipped
    English paragraphs."""
    if cfg.text_file is None and source == Source.tiny:
        return CORPUS, "the tiny model's training text (models/tiny.py)"
    return read_text(cfg.text_file)


class BaselineStage(Stage):
    name = "baseline"
    after = ("load",)

    def run(self, loaded: EagerModel, ctx: ExportContext) -> EagerModel:
        assert ctx.checkpoint is not None and self.plan.validation is not None
        validation = self.plan.validation
        text, source = validation_text(validation.config, self.plan.decoder.build.source)
        model = loaded.model
        ids = text_ids(ctx.checkpoint, model.args.vocab_size, text)
        windows = make_windows(ids, ctx.checkpoint.bos_id, model.args.max_context_len, validation.prompt_tokens,
                               validation.config.max_tokens, source)
        nll = {}
        for adapter in [None, *(a.name for a in ctx.adapters)]:  # the base, then each adapter applied to it
            with active_adapter(model, adapter), model.kv_dtype_as(KvDType.fp32):
                logits = window_logits(full_sequence(model), windows)
            model.reset_cache()
            nll[adapter] = windows.nll(logits)
        component_nll, component_tokens = {}, {}
        for name in (c.name for c in self.plan.language_models if not c.is_decoder):  # the draft, same windows
            other = loaded.components[name]
            with other.kv_dtype_as(KvDType.fp32):
                component_nll[name] = windows.nll(window_logits(full_sequence(other), windows), other.head_ids)
            component_tokens[name] = windows.scored(other.head_ids)
            other.reset_cache()
        image = None
        if self.plan.vision is not None:  # the image prompt validation will give the program, unquantized
            image = unquantized_image_path(model, loaded.components[self.plan.vision.name], windows.windows[0])
        dtype = model.lm_head.weight.dtype
        dtype_name = next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))
        ctx.baseline = BaselineQuality(text=windows, nll=nll.pop(None), dtype=dtype_name,
                                       adapter_nll={name: value for name, value in nll.items() if name is not None},
                                       component_nll=component_nll, component_tokens=component_tokens, image=image)
        return loaded

    def describe(self, loaded: EagerModel, ctx: ExportContext) -> str:
        assert ctx.baseline is not None
        return ctx.baseline.summary()
