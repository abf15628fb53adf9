"""Advise: when the program's perplexity is far above the unquantized model's, measure what would win it back.

Runs after validation, only with ``validation.warn_ppl_increase`` set. Under the threshold it only says so; above
it, each remedy of the quant config is applied to a fresh copy of the model and scored on the validation windows
(``exporters.quant.advice``), and the warning goes into the context for finalize's manifest and the summary.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from exporters.components.language_model import read_calibration
from exporters.config import KvDType
from exporters.context import ExportContext
from exporters.context.artifacts import WrittenProgram
from exporters.plan.footprint import GB, memory_limit
from exporters.quant.advice import Loss, StageSeconds, Trials, advise
from exporters.program.versions import package_versions
from exporters.quant.remedy_cache import RemedyCache, identity
from exporters.runtime.quality import full_sequence, perplexity, window_logits
from exporters.stages.pipeline import Stage
from models.decoder import CausalLM
from models.gguf import llm_exporters_cache

if TYPE_CHECKING:
    from exporters.plan import ExportPlan

log = logging.getLogger("exporters")


class AdviseStage(Stage):
    name = "advise"
    after = ("validate",)

    def __init__(self, plan: ExportPlan) -> None:
        super().__init__(plan)
        assert plan.validation is not None and plan.validation.advise_threshold is not None
        self.threshold = plan.validation.advise_threshold
        self.increase: float | None = None

    def run(self, written: WrittenProgram, ctx: ExportContext) -> WrittenProgram:
        report, baseline, checkpoint = ctx.validation, ctx.baseline, ctx.checkpoint
        assert report is not None and baseline is not None and checkpoint is not None
        if not report.passed:  # the program is rejected; its perplexity says nothing about the scheme
            return written
        if not math.isfinite(report.baseline_perplexity):  # random weights of a large vocabulary: nothing to compare
            return written
        self.increase = report.perplexity / report.baseline_perplexity - 1
        if self.increase <= self.threshold:
            return written
        component, text = self.plan.main, baseline.text
        quant = component.quant

        def build() -> CausalLM:  # the model load built, fresh: the same recipe
            return component.build.build(checkpoint)

        def score(model: CausalLM) -> float:  # as the baseline and the eager side were scored: an fp32 cache
            with model.kv_dtype_as(KvDType.fp32):
                return perplexity(text.nll(window_logits(full_sequence(model), text)), text.scored_tokens)

        # A remedy that holds the model whole is skipped rather than risk the kernel's out-of-memory killer ending the
        # export, whose program is written but not yet accepted.
        footprint, limit = ctx.footprint, memory_limit(self.plan.memory_limit_gb)
        too_big = (None if footprint is None or footprint.advise is None or footprint.advise <= limit else
                   f"it would need about {footprint.advise / GB:.1f} GB (estimated), above the {limit / GB:.1f} GB "
                   "this export may use; an export with those overrides measures it")
        loss = Loss(self.threshold, self.increase, report.eager_perplexity, report.baseline_perplexity)
        seconds = StageSeconds(*(ctx.timings.get(stage, 0.0) for stage in ("load", "quantize", "baseline")))
        cache = RemedyCache(llm_exporters_cache() / "advice", identity(
            self.plan.resolved_config.get("model", {}), checkpoint.weight_stats, text.windows, text.prompt_tokens,
            package_versions()))
        trials = Trials(build, score, lambda model: lambda: read_calibration(
            quant.config.calibration, component.build.source, model, checkpoint), seconds, cache)
        ctx.quality_warning = advise(quant, loss, written.model, trials, too_big)
        return written

    def describe(self, written: WrittenProgram, ctx: ExportContext) -> str:
        if ctx.quality_warning is not None:
            return "WARNING: " + ctx.quality_warning.describe()
        if self.increase is None:
            report = ctx.validation
            if report is not None and report.passed:
                return "skipped: the unquantized model's perplexity is not finite (random weights?)"
            return "skipped: validation failed"
        return f"perplexity {self.increase:+.1%} over the unquantized model, within the {self.threshold:.0%} warning"
