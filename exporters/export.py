"""``export(cfg)``: the whole export as a plain function (the CLI, sweep jobs and tests all call it).

Reads as the outline of an export: check the config (every rule, before any work), build the stages that will
run, and run them once. ``run_stages`` stops after a named stage, for tests and profilers.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from exporters.config import ExportConfig, KvDType, to_typed
from exporters.errors import UserError
from exporters.program.backends import check_backend, runtime_precision
from exporters.program.cache import check_kv_cache
from exporters.program.layouts import LAYOUTS
from exporters.program.methods import check_methods, context_len, tokens_per_call
from exporters.program.weights import check_weights
from exporters.quant.pt2e import check_pt2e
from exporters.quant.schemes import check_quant
from exporters.runtime.memory import reset_peak_rss
from exporters.runtime.quality import check_validation
from exporters.stages.advise import AdviseStage
from exporters.stages.artifacts import ExportResult
from exporters.stages.baseline import BaselineStage, prompt_length
from exporters.stages.bench import BenchStage
from exporters.stages.capture import CaptureStage
from exporters.stages.emit import EmitStage
from exporters.stages.finalize import FinalizeStage
from exporters.stages.load import LoadStage
from exporters.stages.lower import LowerStage
from exporters.stages.pipeline import ExportContext, Stage, StageObserver, run_pipeline
from exporters.stages.pt2e import Pt2eStage
from exporters.stages.quantize import QuantizeStage
from exporters.stages.validate import ValidateStage
from exporters.footprint import MemoryBudget
from exporters.sweeps.summary import check_search
from models.families import check_family
from models.lora import check_adapter_folders

log = logging.getLogger("exporters")


def check_config(cfg: ExportConfig) -> None:
    """Every rule that spans fields or needs a registry, each checked by the module that owns those keys."""
    check_family(cfg.model.family)
    check_adapter_folders(cfg.model.adapters)
    check_backend(cfg.backend, cfg.bench)
    check_quant(cfg.quant, cfg.backend)
    check_pt2e(cfg.quant, cfg.backend, list(cfg.model.adapters))
    check_methods(cfg.export, cfg.backend)
    check_kv_cache(cfg.export, cfg.backend, cfg.quant)
    check_weights(cfg.export, cfg.backend, list(cfg.model.adapters))
    check_validation(cfg.validation, enabled=cfg.validate)
    for name in ("prompt_tokens", "steps", "repeats"):
        if getattr(cfg.benchmark, name) < 1:
            raise UserError(f"benchmark.{name}={getattr(cfg.benchmark, name)}: use 1 or more.")
    check_search(cfg.search)


def build_stages(cfg: ExportConfig, output_dir: Path) -> list[Stage]:
    """The stages this export runs, each built from its own part of the config. Stages that would do nothing
    are left out (validation's two with validate=false, bench unless asked for), so none reports "done"."""
    ex, backend = cfg.export, cfg.backend
    context = context_len(ex)  # KV-cache positions
    call_tokens = tokens_per_call(ex.max_seq_len, context)  # most tokens one call of a prompt method takes
    prompt_tokens = prompt_length(cfg.validation.prompt_tokens, context,
                                  None if backend.dynamic_shapes else ex.prefill_chunk)
    validating = cfg.validate
    pt2e = cfg.quant.pt2e is not None
    return [
        LoadStage(cfg.model, context, work_dir=output_dir, attention=backend.attention, kv_dtype=ex.kv_dtype,
                  attention_sink=ex.attention_sink, call_tokens=call_tokens,
                  budget=MemoryBudget(cfg.quant, ex.tied_embedding, validating, ex.memory_limit_gb)),
        *([BaselineStage(cfg.validation, prompt_tokens, cfg.model.source)] if validating else []),
        QuantizeStage(cfg.quant, ex.tied_embedding, cfg.model.source),
        *([Pt2eStage(cfg.quant, call_tokens, cfg.model.source, reference=validating)] if pt2e else []),
        # Validation runs the undelegated programs where the delegate cannot run here; with PT2E they are also
        # the eager side (the quantized model exists only as the converted graph).
        CaptureStage(ex.methods, LAYOUTS[ex.layout], call_tokens, backend.dynamic_shapes, ex.prefill_chunk,
                     keep_undelegated=validating and (pt2e or not backend.runs_here)),
        LowerStage(backend, ex.max_seq_len, ex.weights),
        EmitStage(output_dir / ex.output_name, ex.weights),
        *([ValidateStage(cfg.quant, runs_here=backend.runs_here, runs_in=runtime_precision(backend),
                         eager_from_graphs=pt2e,
                         kv_tolerance=cfg.validation.int8_kv if ex.kv_dtype != KvDType.fp32 else None)]
          if validating else []),
        *([AdviseStage(cfg.quant, cfg.validation.warn_ppl_increase, cfg.model, context, backend.attention)]
          if validating and cfg.validation.warn_ppl_increase is not None else []),
        FinalizeStage(LAYOUTS[ex.layout]),
        *([BenchStage(cfg.benchmark, context)] if cfg.bench else []),
    ]


def checked_config(cfg: DictConfig | ExportConfig) -> ExportConfig:
    """``cfg`` as a typed config that passed every check: what an export would run with."""
    return _typed(cfg)[0]


def _typed(cfg: DictConfig | ExportConfig) -> tuple[ExportConfig, dict[str, Any]]:
    """The checked config, and the resolved form the manifest records."""
    if isinstance(cfg, DictConfig):
        typed, resolved = to_typed(cfg), OmegaConf.to_container(cfg, resolve=True)
    else:
        typed, resolved = cfg, dataclasses.asdict(cfg)
    check_config(typed)
    assert isinstance(resolved, dict)
    return typed, resolved


def run_stages(cfg: DictConfig | ExportConfig, output_dir: str | Path | None = None, *,
               stop_after: str | None = None, observer: StageObserver | None = None) -> tuple[Any, ExportContext]:
    """Check ``cfg`` and run its stages (up to ``stop_after``); the last artifact and the run's context."""
    typed, resolved = _typed(cfg)
    target = output_dir or typed.export.output_dir
    if target is None:
        raise UserError("no output folder: pass output_dir to export() or set export.output_dir.")
    out = Path(target)
    out.mkdir(parents=True, exist_ok=True)
    reset_peak_rss()  # the manifest's peak RSS is this export's, not the process's whole life
    ctx = ExportContext(config=typed, resolved_config=resolved, output_dir=out)
    artifact = run_pipeline(build_stages(typed, out), ctx, stop_after=stop_after, observer=observer)
    return artifact, ctx


def export(cfg: DictConfig | ExportConfig, output_dir: str | Path | None = None) -> ExportResult:
    """Export one model as described by a composed config; where the program and its manifest are."""
    result, _ = run_stages(cfg, output_dir)
    assert isinstance(result, ExportResult)
    return result
