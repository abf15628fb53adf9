"""Load: open every part's checkpoint, estimate the export's memory, then build each model with its weights.

Each part (``exporters.components``) opens its checkpoint and checks its shapes before any weight is read, so a
combination that cannot work, or a model that cannot fit, fails in seconds. Then each builds its model (variants attach to the decoder's) in registry order.
"""

from __future__ import annotations

import logging
from typing import Any

from exporters.components import parts
from exporters.context import ExportContext
from exporters.context.artifacts import EagerModel
from exporters.plan.footprint import check_fits
from exporters.stages.pipeline import Stage

log = logging.getLogger("exporters")


def opened(ctx: ExportContext) -> list[Any]:
    """Every checkpoint the parts opened, each once (parts may share one)."""
    found = {id(c): c for r in ctx.records.values() for c in [getattr(r, "checkpoint", None)] if c is not None}
    return list(found.values())


class LoadStage(Stage):
    name = "load"

    def run(self, artifact: None, ctx: ExportContext) -> EagerModel:
        found = parts(self.plan)
        # The export's memory, estimated from the shapes alone and checked before any weight is read.
        footprints = [(part.name, f) for part in found for f in [part.kind.open(part, ctx)] if f is not None]
        footprint = footprints[0][1]
        for _, other in footprints[1:]:
            footprint = footprint.beside(other)
        check_fits(footprint, self.plan.memory_limit_gb)
        ctx.footprint = footprint
        held = f" ({', '.join(name for name, _ in footprints)})" if len(footprints) > 1 else ""
        log.info("  load: %s%s", footprint.describe(), held)
        models: dict[str, Any] = {}
        for part in found:
            part.kind.load(part, ctx, models)
        for checkpoint in opened(ctx):  # read lazily: none changed meanwhile
            checkpoint.check_unchanged()
        main = models.pop(self.plan.decoder.name)
        return EagerModel(main, components=models)

    def describe(self, loaded: EagerModel, ctx: ExportContext) -> str:
        models = self.models_of(loaded)
        return "".join(part.kind.describe("load", part, ctx, models) for part in parts(self.plan))
