"""Load: pick the checkpoint source, build the exportable decoder, load its weights and attach its adapters.

The decoder is built from the plan's :class:`~exporters.plan.ModelBuild`, the recipe advise and the memory
estimate use too. Adapters (``model.adapters``) are read and checked against the loaded base here, the first
stage, so a folder that does not fit fails before any long stage; PEFT attaches them (``models.lora``).
"""

from __future__ import annotations

import logging

from exporters.footprint import MemoryBudget
from exporters.plan.component import Component
from exporters.program.draft import check_pair
from exporters.program.hybrid import check_hybrid
from exporters.program.vision import vision_footprint
from models.vision_encoder import vision_parameters
from exporters.quant.rotation import check_rotation
from exporters.stages.artifacts import EagerModel, summary
from exporters.stages.pipeline import ExportContext, Stage
from models.checkpoint import stored_bytes
from models.decoder import CausalLM
from models.families import family_of_config
from exporters.quant.schemes import DTYPES
from models.lora import attach_adapters, read_adapter
from models.lora_slots import INT8, attach_slots, pack, slot_geometry
from models.vision import text_only

log = logging.getLogger("exporters")


class LoadStage(Stage):
    name = "load"

    def run(self, artifact: None, ctx: ExportContext) -> EagerModel:
        build = self.plan.decoder.build
        checkpoint = build.checkpoint(ctx.output_dir)
        ctx.checkpoint = checkpoint
        # The export's memory, estimated from the shapes alone and checked before any weight is read.
        shapes = build.build(checkpoint, device="meta")
        self.check_shapes(shapes, self.plan.decoder)
        budget = MemoryBudget.of(self.plan)
        footprint = budget.estimate(shapes, stored_bytes(checkpoint, shapes))
        components = {}
        draft = self.plan.draft
        if draft is not None:  # the pair is checked before either model's weights are read
            draft_checkpoint = draft.build.checkpoint(ctx.output_dir)
            draft_shapes = draft.build.build(draft_checkpoint, device="meta")
            self.check_shapes(draft_shapes, draft)
            check_pair(checkpoint, draft_checkpoint, shapes.parameter_count(), draft_shapes.parameter_count())
            ctx.component_checkpoints[draft.name] = draft_checkpoint
            footprint = footprint.beside(MemoryBudget.of(self.plan, draft).estimate(
                draft_shapes, stored_bytes(draft_checkpoint, draft_shapes)))
        vision = self.plan.vision
        if vision is not None:  # the image encoder, alive beside the decoder from load to the end
            footprint = footprint.beside(vision_footprint(vision_parameters(checkpoint.hf_config)))
        ctx.footprint = budget.check(footprint)
        log.info("  load: %s%s", ctx.footprint.describe(), " (target and draft)" if draft is not None else "")
        model = build.build(checkpoint)
        ctx.adapters = [read_adapter(name, folder, model) for name, folder in build.model.adapters.items()]
        attach_adapters(model, ctx.adapters)
        slots = self.plan.decoder.methods.slots
        if slots is not None:  # swappable: PEFT's adapters stay the eager reference, the slots are what is exported
            dtype = DTYPES[str(self.plan.decoder.quant.config.dtype)]  # the activations' the slots multiply
            geometry = slot_geometry(model, list(slots.targets), slots.rank, dtype, INT8 if slots.eight_bit else None)
            attach_slots(model, geometry)
            ctx.packed_adapters = {a.name: pack(a.name, a.config, a.matrices, geometry) for a in ctx.adapters}
        if draft is not None:
            components[draft.name] = draft.build.build(ctx.component_checkpoints[draft.name])
        if vision is not None:  # the image encoder, from the decoder's checkpoint folder
            ctx.component_checkpoints[vision.name] = checkpoint
            components[vision.name] = vision.build.build(checkpoint)
        for opened in (checkpoint, *ctx.component_checkpoints.values()):
            opened.check_unchanged()
        return EagerModel(model, components=components)

    def check_shapes(self, shapes: CausalLM, component: Component) -> None:
        """What a component's options need of its model's shapes, checked before any of its weights is read."""
        check_rotation(shapes, component.quant.config)
        check_hybrid(shapes, self.plan, component)

    def describe(self, loaded: EagerModel, ctx: ExportContext) -> str:
        assert ctx.checkpoint is not None
        family = family_of_config(ctx.checkpoint.hf_config)
        adapters = "".join(f"; adapter {a.describe()}" for a in ctx.adapters)
        others = "".join(f"; {name}: {summary(m)}" for name, m in loaded.components.items())
        alone = text_only(ctx.checkpoint.hf_config)
        return f"{family.name if family else 'unknown'} family, {loaded.summary()}{adapters}{others}" + (
            f"; {alone}" if alone else "")
