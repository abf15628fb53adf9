"""Baseline: score the unquantized models on the validation text, before quantization changes them.

Cuts the validation text into the windows validation will drive the program over, and asks each part to record what
its unquantized model does on them (``exporters.components``): the decoder's negative log-likelihood is the
perplexity quality loss is measured against; every other part records its own.
Runs only with validation on.
"""

from __future__ import annotations

from exporters.components import parts
from exporters.config import Source, ValidationConfig
from exporters.context import ExportContext
from exporters.context.artifacts import BaselineQuality, EagerModel
from exporters.quant.schemes import DTYPES
from exporters.runtime.quality import make_windows, read_text, text_ids
from exporters.stages.pipeline import Stage
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
        models = self.models_of(loaded)
        if not self.plan.main.is_language_model:  # a speech model: each part scores what it validates on its own
            for part in parts(self.plan):
                part.kind.baseline(part, ctx, models, None)
            return loaded
        validation = self.plan.validation
        text, source = validation_text(validation.config, self.plan.main.build.source)
        model = loaded.model
        ids = text_ids(ctx.checkpoint, model.args.vocab_size, text)
        windows = make_windows(ids, ctx.checkpoint.bos_id, model.args.max_context_len, validation.prompt_tokens,
                               validation.config.max_tokens, source)
        for part in parts(self.plan):
            part.kind.baseline(part, ctx, models, windows)
        dtype = model.lm_head.weight.dtype
        dtype_name = next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))
        ctx.baseline = BaselineQuality(text=windows, nll=ctx.main.nll, dtype=dtype_name)
        return loaded

    def describe(self, loaded: EagerModel, ctx: ExportContext) -> str:
        if ctx.baseline is None:
            models = self.models_of(loaded)
            return "".join(part.kind.describe("baseline", part, ctx, models) for part in parts(self.plan))
        return ctx.baseline.summary()
