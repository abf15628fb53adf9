"""Swappable LoRA slots (``export.adapters=swappable``): the decoder's methods read slots ``set_adapter`` writes.

The plan sizes the slots once (``exporters.program.swappable.slot_plan``, on the decoder's method table). Load
attaches them after PEFT's adapters (``models.lora_slots``) and lays out each adapter given for them; capture adds
``set_adapter``; lowering moves each slot's product after its layer's projections and adds the constants an app
reads; validation sets each adapter and runs the base's methods against PEFT's model of it; finalize writes each as
``adapters/<name>.ptd`` and the manifest's ``swappable``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from exporters.backends import SWAPS_ADAPTERS
from exporters.components.adapters import ADAPTERS
from exporters.components.kind import Bundled, Finalized, Kind, Part
from exporters.config import ExportConfig
from exporters.manifest import DataFile, Manifest, Signature, SwappableEntry
from exporters.output.files import private_path, sha256_of
from exporters.program.internals import write_tensor_file
from exporters.program.signatures import signature
from exporters.program.swappable import (SWAP_HOWTO, adapter_file, check_swappable, products_after_projections,
                                         slot_constants, slot_plan)
from exporters.quant.schemes import DTYPES
from exporters.validation.methods import validate_methods
from models.lora_slots import INT8, SET_ADAPTER, attach_slots, capturing_set_adapter, pack, slot_geometry

if TYPE_CHECKING:
    from exporters.context import ExportContext
    from exporters.context.artifacts import WrittenProgram
    from exporters.plan import ExportPlan
    from exporters.program.lengths import Lengths
    from exporters.validation.under_test import ProgramUnderTest

log = logging.getLogger("exporters")


@dataclass
class SlotsRecord:
    # load: each adapter given, laid out as set_adapter's inputs (models.lora_slots.pack)
    packed: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


class Slots(Kind):
    name = "slots"
    variant = True

    def check(self, cfg: ExportConfig, lengths: Lengths) -> None:
        check_swappable(cfg, SWAPS_ADAPTERS)
        slot_plan(cfg)  # every adapter given fits the slots

    def applies(self, plan: ExportPlan) -> bool:
        return plan.main.methods.slots is not None

    def load(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        """After PEFT's adapters (they stay the eager reference): the slots, and each adapter laid out for them."""
        model, slots = models[part.component.name], part.component.methods.slots
        assert slots is not None
        dtype = DTYPES[str(part.component.quant.config.dtype)]  # the activations' the slots multiply
        geometry = slot_geometry(model, list(slots.targets), slots.rank, dtype, INT8 if slots.eight_bit else None)
        attach_slots(model, geometry)
        adapters = ctx.records[ADAPTERS].adapters if ADAPTERS in ctx.records else []
        ctx.records[part.name] = SlotsRecord({a.name: pack(a.name, a.config, a.matrices, geometry) for a in adapters})

    def capture(self, part: Part, models: dict[str, Any]) -> dict[str, tuple[Any, Signature]]:
        """set_adapter, from the decoder's module: its buffers named as the methods read them."""
        model = models[part.component.name]
        with torch.no_grad(), capturing_set_adapter(model) as inputs:
            program = torch.export.export(model, inputs, strict=False)
        found = signature(program)
        names = model.get_submodule("lora_slots").geometry.input_names()
        return {SET_ADAPTER: (program, Signature(inputs=[dataclasses.replace(spec, name=name) for spec, name in
                                                          zip(found.inputs, names, strict=True)],
                                                  outputs=found.outputs))}

    def passes(self, part: Part) -> list[Any]:
        return [products_after_projections()]

    def constants(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> dict[str, Any]:
        """What an app needs to fill set_adapter's inputs."""
        return slot_constants(models[part.component.name].get_submodule("lora_slots").geometry)

    def validate(self, part: Part, ctx: ExportContext, under: ProgramUnderTest, models: dict[str, Any]) -> None:
        """Each adapter given, set by set_adapter, then the base's methods against PEFT's model of it (recorded as
        the adapter's validation)."""
        adapters = ctx.record(ADAPTERS)
        for adapter, tensors in ctx.record(part.name).packed.items():
            under.program.run(SET_ADAPTER, *tensors.values())
            adapters.validation[adapter] = validate_methods(
                models[part.component.name], under, ctx.plan.methods.of_adapter(None), adapter,
                adapters.perplexity(adapter, under.text.scored_tokens))
            log.info("  validate: adapter %s %s", adapter, "passed" if adapters.validation[adapter].passed else "FAILED")

    def finalize(self, part: Part, ctx: ExportContext, written: WrittenProgram, pte: Path) -> Finalized:
        """The manifest's record of the slots, and each adapter given written as ``adapters/<name>.ptd`` under a
        private name, renamed into place with the rest."""
        out_dir = pte.parent
        geometry = written.model.get_submodule("lora_slots").geometry
        staged, files = {}, {}
        for name, tensors in ctx.record(part.name).packed.items():
            final = adapter_file(out_dir, name)
            final.parent.mkdir(exist_ok=True)
            staged[final] = private_path(final, "staged")
            write_tensor_file(tensors, staged[final])
            files[name] = DataFile(file=str(final.relative_to(out_dir)), size_bytes=staged[final].stat().st_size,
                                   sha256=sha256_of(staged[final]), entries=len(tensors))
        entry = SwappableEntry(method=SET_ADAPTER, inputs=written.methods.signatures[SET_ADAPTER].inputs,
                               slots=geometry.to_json(), adapters=files, how=SWAP_HOWTO)
        return Finalized(fields={"swappable": entry}, staged=staged)

    def bundle(self, m: Manifest) -> Bundled:
        """The bundle carries each adapter's file and says how an app sets one."""
        if m.swappable is None:
            return Bundled()
        return Bundled(readme=bundle_readme(m), files=[entry.file for entry in m.swappable.adapters.values()])


def bundle_readme(m: Manifest) -> str:
    """The bundle README's section on the slots: set_adapter's inputs, the files, each adapter's quality."""
    s = m.swappable
    slots = s.slots
    targets = ", ".join(f"`{t['kind']}` ({t['out_features']} x {t['in_features']})" for t in slots["targets"])
    inputs = "\n".join(f"| {i} | `{spec.name}` | {spec.dtype} {spec.shape} |" for i, spec in enumerate(s.inputs))
    rows = "\n".join(f"| `{name}` | `{s.adapters[name].file}` ({s.adapters[name].size_bytes / 1e6:.2f} MB) | "
                     f"r={'/'.join(map(str, a.rank))}, alpha {a.lora_alpha}{', rsLoRA' if a.use_rslora else ''}, "
                     f"{a.layers} layers ({', '.join(a.targets)}) | "
                     + (a.validation.quality() if a.validation else "not validated") + " |"
                     for name, a in m.adapters.items() if name in s.adapters)
    given = (f"""Adapters exported with it, each validated in the runtime against PEFT:

| adapter | file | what it changes | quality |
|---|---|---|---|
{rows}

""" if rows else "")
    return f"""## LoRA adapters, swapped at run time

The base model's methods read LoRA slots of rank {slots['rank']} on {targets} in each of its {slots['layers']} layers
({slots['dtype']}). The method `{s.method}` writes them, and every method computes with what it wrote, until the
next call of `{s.method}`: any PEFT LoRA adapter whose targets are among those and whose rank is at most
{slots['rank']} is data for this program, including one trained after it. `{s.method}` takes, in this order (the
constant method `get_lora_inputs` lists the names), `Aᵀ` and `(scale·B)ᵀ` of every layer, zero past an adapter's
rank and where it changes nothing:

| input | name | dtype, shape |
|---|---|---|
{inputs}

{s.how}

{given}`python -m exporters.adapter <this folder> <PEFT folder> out=<file.ptd>` turns another adapter into such a file,
checked against these shapes; `python -m exporters.generate <this folder> prompt="..." adapter=<name or file>` runs it.

"""
