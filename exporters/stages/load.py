"""Load: open every part's checkpoint, estimate the export's memory, then build each model with its weights.

Each part (``exporters.components``) opens its checkpoint and checks its shapes before any weight is read, so a
combination that cannot work, or a model that cannot fit, fails in seconds. Then each builds its model (variants attach to the decoder's) in registry order.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from exporters.components import parts
from exporters.context import ExportContext
from exporters.context.artifacts import EagerModel
from exporters.plan import ExportPlan
from exporters.plan.footprint import Footprint, check_fits
from exporters.stages.pipeline import Stage

log = logging.getLogger("exporters")


def opened(ctx: ExportContext) -> list[Any]:
    """Every checkpoint the parts opened, each once (parts may share one)."""
    found = {id(c): c for r in ctx.records.values() for c in [getattr(r, "checkpoint", None)] if c is not None}
    return list(found.values())


def estimate(ctx: ExportContext) -> tuple[Footprint, list[str]]:
    """Every part opened (its checkpoint read or converted, its shapes built on the meta device) and the export's
    memory estimated from them, before any weight is read; the parts it counts."""
    footprints = [(part.name, f) for part in parts(ctx.plan) for f in [part.kind.open(part, ctx)] if f is not None]
    footprint = footprints[0][1]
    for _, other in footprints[1:]:
        footprint = footprint.beside(other)
    return footprint, [name for name, _ in footprints]


def planned_footprint(plan: ExportPlan, work_dir: Path) -> Footprint:
    """The export's footprint as the load stage estimates it, from ``plan`` alone (a tiny or GGUF source written
    under ``work_dir``); not checked against the memory available."""
    return estimate(ExportContext(plan, work_dir))[0]


class LoadStage(Stage):
    name = "load"

    def run(self, artifact: None, ctx: ExportContext) -> EagerModel:
        footprint, counted = estimate(ctx)
        check_fits(footprint, self.plan.memory_limit_gb)
        ctx.footprint = footprint
        held = f" ({', '.join(counted)})" if len(counted) > 1 else ""
        log.info("  load: %s%s", footprint.describe(), held)
        models: dict[str, Any] = {}
        for part in parts(self.plan):
            part.kind.load(part, ctx, models)
        for checkpoint in opened(ctx):  # read lazily: none changed meanwhile
            checkpoint.check_unchanged()
        main = models.pop(self.plan.main.name)
        return EagerModel(main, components=models)

    def describe(self, loaded: EagerModel, ctx: ExportContext) -> str:
        models = self.models_of(loaded)
        return "".join(part.kind.describe("load", part, ctx, models) for part in parts(self.plan))
