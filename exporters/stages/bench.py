"""Bench: measure the written program as an app would run it, and add the numbers to ``manifest.json``.

Runs after ``finalize``, so the export's own wall time and peak RSS (the manifest's ``resources``) do not
include it. On by default in sweeps (``-m``), off for a single export; ``bench=true/false`` forces it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict

from exporters.config import BenchmarkConfig
from exporters.context import ExportContext
from exporters.context.artifacts import ExportResult
from exporters.manifest import BenchResult
from exporters.runtime.driver import Driver
from exporters.runtime.memory import memory_after_load_mb, rss_after_load_mb
from exporters.runtime.programs import LoadedProgram
from exporters.runtime.speed import measure_speed
from exporters.stages.pipeline import Stage


def bench_lengths(settings: BenchmarkConfig, max_context_len: int) -> tuple[int, int]:
    """Prompt tokens and decode steps that fit the cache: the configured ones, else half and half."""
    prompt = min(settings.prompt_tokens, max_context_len // 2)
    return prompt, min(settings.steps, max_context_len - prompt)


class BenchStage(Stage):
    name = "bench"
    after = ("finalize",)

    def run(self, result: ExportResult, ctx: ExportContext) -> ExportResult:
        start = time.perf_counter()
        program = LoadedProgram(result.pte_path)
        driver = Driver.of(program)
        settings = self.plan.bench
        assert settings is not None
        prompt_tokens, steps = bench_lengths(settings, self.plan.lengths.context)
        vocab_size = int(program.constant("get_vocab_size"))
        speed = measure_speed(driver, prompt_tokens, steps, settings.repeats, vocab_size)
        del program, driver
        loaded = [speed.prompt_method, speed.step_method]
        rss, pss = memory_after_load_mb(result.pte_path, loaded)
        bench = BenchResult(
            **asdict(speed),
            rss_after_load_mb=rss,
            rss_after_load_without_weight_cache_mb=rss_after_load_mb(result.pte_path, loaded, weight_cache=False),
            pss_after_load_mb=pss,
            seconds=round(time.perf_counter() - start, 1),
        )
        manifest = dataclasses.replace(result.manifest, bench=bench)
        manifest.write(result.manifest_path)
        return dataclasses.replace(result, manifest=manifest)
