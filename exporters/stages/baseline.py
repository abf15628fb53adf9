"""Baseline: score the unquantized model on the validation text, before quantization changes it.

Cuts the validation text into the windows validation will drive the program over, and records the
unquantized model's negative log-likelihood on them: the perplexity quality loss is measured against.
Runs only with validation on.
"""

from __future__ import annotations

from exporters.config import KvDType, Source, ValidationConfig
from exporters.quant.schemes import DTYPES
from exporters.runtime.quality import full_sequence, make_windows, read_text, text_ids, window_logits
from exporters.stages.artifacts import BaselineQuality, EagerModel
from exporters.stages.pipeline import ExportContext, Stage
from models.lora import active_adapter
from models.tiny import CORPUS


def prompt_length(requested: int, max_context_len: int, static_chunk: int | None) -> int:
    """Prompt tokens per window: at most half the context, so each window has tokens left to decode; on
    static-shape backends a whole number of prefill chunks (no padding)."""
    tokens = min(requested, max(1, max_context_len // 2))
    if static_chunk is None:
        return tokens
    return max(static_chunk, tokens - tokens % static_chunk)


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

    def __init__(self, validation_cfg: ValidationConfig, prompt_tokens: int, source: Source) -> None:
        self.cfg = validation_cfg
        self.prompt_tokens = prompt_tokens
        self.source = source

    def run(self, loaded: EagerModel, ctx: ExportContext) -> EagerModel:
        assert ctx.checkpoint is not None
        text, source = validation_text(self.cfg, self.source)
        model = loaded.model
        ids = text_ids(ctx.checkpoint, model.args.vocab_size, text)
        windows = make_windows(ids, ctx.checkpoint.bos_id, model.args.max_context_len, self.prompt_tokens,
                               self.cfg.max_tokens, source)
        nll = {}
        for adapter in [None, *(a.name for a in ctx.adapters)]:  # the base, then each adapter applied to it
            with active_adapter(model, adapter), model.kv_dtype_as(KvDType.fp32):
                logits = window_logits(full_sequence(model), windows)
            model.reset_cache()
            nll[adapter] = windows.nll(logits)
        dtype = model.lm_head.weight.dtype
        dtype_name = next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))
        ctx.baseline = BaselineQuality(text=windows, nll=nll.pop(None), dtype=dtype_name,
                                       adapter_nll={name: value for name, value in nll.items() if name is not None})
        return loaded

    def describe(self, loaded: EagerModel, ctx: ExportContext) -> str:
        assert ctx.baseline is not None
        return ctx.baseline.summary()
