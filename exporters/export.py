"""``export(cfg)``: the whole export as a plain function (the CLI, sweep jobs and tests all call it).

Reads as the outline of an export: check the config and resolve its plan (every rule and every decision, before
any work: ``exporters.plan``), build the stages the plan runs, and run them once. ``run_stages`` stops after a
named stage, for tests and profilers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from exporters.config import ExportConfig
from exporters.errors import Interrupted, UserError
from exporters.plan import ExportPlan
from exporters.components.resolve import check_config, plan_export
from exporters.output.files import private_files
from exporters.output.folder import check_writable, held, is_no_room, no_room
from exporters.runtime.memory import reset_peak_rss
from exporters.stages.advise import AdviseStage
from exporters.context.artifacts import ExportResult
from exporters.stages.baseline import BaselineStage
from exporters.stages.bench import BenchStage
from exporters.stages.capture import CaptureStage
from exporters.stages.emit import EmitStage, provisional_path
from exporters.stages.finalize import FinalizeStage
from exporters.stages.load import LoadStage
from exporters.stages.lower import LowerStage
from exporters.stages.pipeline import ExportContext, Stage, StageObserver, run_pipeline
from exporters.stages.pt2e import Pt2eStage
from exporters.stages.quantize import QuantizeStage
from exporters.stages.validate import ValidateStage

__all__ = ["ExportResult", "build_stages", "check_config", "checked_config", "export", "plan_export", "run_stages"]

log = logging.getLogger("exporters")

#: What to do about an output folder that cannot be written.
WRITABLE_FIX = "Choose a folder you can write: hydra.run.dir=<dir> on the command line, or export.output_dir=<dir>."

#: Every stage by name; the plan says which run (exporters.plan.ExportPlan.stage_names).
STAGES: dict[str, type[Stage]] = {stage.name: stage for stage in (
    LoadStage, BaselineStage, QuantizeStage, Pt2eStage, CaptureStage, LowerStage, EmitStage, ValidateStage,
    AdviseStage, FinalizeStage, BenchStage)}


def build_stages(plan: ExportPlan) -> list[Stage]:
    """The stages ``plan`` runs, each built from the plan. Stages that would do nothing are left out (validation's
    with validate=false, advise without a warning threshold, bench unless asked for), so none reports "done"."""
    return [STAGES[name](plan) for name in plan.stage_names]


def checked_config(cfg: DictConfig | ExportConfig) -> ExportConfig:
    """``cfg`` as a typed config that passed every check: what an export would run with."""
    return plan_export(cfg).config


def run_stages(cfg: DictConfig | ExportConfig | ExportPlan, output_dir: str | Path | None = None, *,
               stop_after: str | None = None, observer: StageObserver | None = None) -> tuple[Any, ExportContext]:
    """Check ``cfg``, resolve its plan and run its stages (up to ``stop_after``); the last artifact and the run's
    context."""
    plan = cfg if isinstance(cfg, ExportPlan) else plan_export(cfg)
    target = output_dir or plan.config.export.output_dir
    if target is None:
        raise UserError("no output folder: pass output_dir to export() or set export.output_dir.")
    out = Path(target)
    check_writable(out, "the output folder", WRITABLE_FIX)
    reset_peak_rss()  # the manifest's peak RSS is this export's, not the process's whole life
    ctx = ExportContext(plan=plan, output_dir=out)
    with held(out):
        try:
            artifact = run_pipeline(build_stages(plan), ctx, stop_after=stop_after, observer=observer)
        except BaseException as e:  # an error or a signal: no program that looks written (a rejected one is kept)
            remove_provisional_files(out / plan.output_name)
            if isinstance(e, Interrupted) and "finalize" in ctx.timings:  # bench: the program is in place
                e.kept = str(out / plan.output_name)
            if is_no_room(e):
                name = Path(e.filename).name if e.filename else "the export's files"  # type: ignore[union-attr]
                raise no_room(e, name, out, None) from None  # type: ignore[arg-type]
            raise
    return artifact, ctx


def remove_provisional_files(final: Path) -> None:
    """The program and data files emit wrote under their provisional name, before finalize accepted them, and the
    temporary files of writes a signal or an error cut short (this process's: another's may still be writing)."""
    provisional = provisional_path(final)
    for path in final.parent.glob(f"{provisional.stem}*"):
        if path.suffix in (".pte", ".ptd"):
            path.unlink(missing_ok=True)
    for path in private_files(final.parent):
        path.unlink(missing_ok=True)


def export(cfg: DictConfig | ExportConfig | ExportPlan, output_dir: str | Path | None = None) -> ExportResult:
    """Export one model as described by a composed config (or its plan); where the program and its manifest are."""
    result, _ = run_stages(cfg, output_dir)
    assert isinstance(result, ExportResult)
    return result
