"""``export(cfg)``: the whole export as a plain function (the CLI and the tests both call it)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from exporters.stages.artifacts import ExportResult
from exporters.runtime.memory import reset_peak_rss
from exporters.config import ExportConfig, check_config, to_typed
from exporters.errors import UserError
from exporters.program.layouts import LAYOUTS
from exporters.stages.pipeline import Stage, run_pipeline
from exporters.stages.bench import BenchStage
from exporters.stages.capture import CaptureStage
from exporters.stages.emit import EmitStage
from exporters.stages.load import LoadStage
from exporters.stages.lower import LowerStage
from exporters.stages.finalize import FinalizeStage
from exporters.stages.quantize import QuantizeStage
from exporters.stages.baseline import ReferenceStage, prompt_length
from exporters.stages.validate import Tolerance, ValidateStage

log = logging.getLogger("exporters")


def build_stages(cfg: ExportConfig, output_dir: Path) -> list[Stage]:
    """The stages that make and check the program (load .. validate); each gets only its own part of the config."""
    ex = cfg.export
    prompt_tokens = prompt_length(cfg.validation.prompt_tokens, ex.max_seq_len,
                                  None if cfg.backend.dynamic_shapes else ex.prefill_chunk)
    return [
        LoadStage(cfg.model, ex.max_seq_len, work_dir=output_dir, attention=cfg.backend.attention),
        ReferenceStage(cfg.validation, prompt_tokens, enabled=cfg.validate),
        QuantizeStage(cfg.quant, ex.tied_embedding),
        CaptureStage(ex.methods, LAYOUTS[ex.layout], ex.max_seq_len, cfg.backend.dynamic_shapes, ex.prefill_chunk,
                     keep_reference=cfg.validate and not cfg.backend.runs_here),
        LowerStage(cfg.backend, ex.max_seq_len),
        EmitStage(output_dir / ex.output_name),
        ValidateStage(Tolerance.of(cfg.quant), enabled=cfg.validate, runs_here=cfg.backend.runs_here),
    ]


def delivery_stages(cfg: ExportConfig, resolved: dict[str, Any], timings: dict[str, float]) -> list[Stage]:
    """The stages after the program is checked: the manifest records ``timings`` of the stages before."""
    return [
        FinalizeStage(resolved, timings, LAYOUTS[cfg.export.layout]),
        BenchStage(cfg.benchmark, cfg.export.max_seq_len, enabled=bool(cfg.bench) and cfg.backend.runs_here),
    ]


def export(cfg: DictConfig | ExportConfig, output_dir: str | Path | None = None) -> ExportResult:
    """Export one model as described by a composed config; returns where the program and manifest are."""
    if isinstance(cfg, DictConfig):
        typed = to_typed(cfg)
        resolved = OmegaConf.to_container(cfg, resolve=True)
    else:
        check_config(cfg)
        typed, resolved = cfg, dataclasses.asdict(cfg)
    target = output_dir or typed.export.output_dir
    if target is None:
        raise UserError("no output folder: pass output_dir to export() or set export.output_dir.")
    out = Path(target)
    out.mkdir(parents=True, exist_ok=True)
    assert isinstance(resolved, dict)
    reset_peak_rss()  # the manifest's peak RSS is this export's, not the process's whole life
    making = build_stages(typed, out)
    total = len(making) + 2
    validated, timings = run_pipeline(making, total=total)
    result, _ = run_pipeline(delivery_stages(typed, resolved, timings), validated, first=len(making) + 1, total=total)
    assert isinstance(result, ExportResult)
    return result
