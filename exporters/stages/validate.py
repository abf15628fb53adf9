"""Validate: run the written ``.pte`` over the validation text and compare each part with its eager model.

The program is loaded once (or, where its delegate cannot run here, the undelegated programs stand in for it) and
each part checks its methods against its eager model (``exporters.components``; the routines are
``exporters.validation``), the language models on the windows the ``baseline`` stage made. The verdicts are facts
for finalize, in the parts' records.
"""

from __future__ import annotations

from exporters.components import parts
from exporters.context import ExportContext
from exporters.context.artifacts import WrittenProgram
from exporters.manifest import Checked
from exporters.runtime.programs import CapturedPrograms, LoadedProgram
from exporters.stages.pipeline import Stage
from exporters.validation.under_test import ProgramUnderTest


class ValidateStage(Stage):
    name = "validate"
    after = ("baseline", "emit")

    def run(self, written: WrittenProgram, ctx: ExportContext) -> WrittenProgram:
        plan = self.plan.validation
        assert plan is not None and (ctx.baseline is not None or not self.plan.main.is_language_model)
        undelegated = None
        if written.undelegated is not None:
            undelegated = CapturedPrograms(written.undelegated, written.model.state_buffers())
        if plan.in_runtime:
            program: LoadedProgram | CapturedPrograms = LoadedProgram(written.path, data_paths=written.data_paths)
            checked: Checked = "runtime"
        else:
            assert undelegated is not None, "capture keeps undelegated programs for such backends"
            program, checked = undelegated, "undelegated programs"
        under = ProgramUnderTest(program, checked, ctx.baseline, plan.tolerance, self.plan.lengths.context,
                                 eager_graphs=undelegated if plan.eager_from_graphs else None, runs_in=plan.runs_in,
                                 eager_kv_dtype=str(plan.eager_kv_dtype) if plan.eager_kv_dtype else None)
        models = self.models_of(written)
        for part in parts(self.plan):
            part.kind.validate(part, ctx, under, models)
        return written  # unchanged: the verdicts are facts for finalize, in the context

    def describe(self, written: WrittenProgram, ctx: ExportContext) -> str:
        models = self.models_of(written)
        return "".join(part.kind.describe("validate", part, ctx, models) for part in parts(self.plan))
