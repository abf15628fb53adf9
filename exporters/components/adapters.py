"""LoRA adapters: variants of the decoder, each applied over its stored weights (``model.adapters``).

Each folder is read and checked against the loaded base, and attached with PEFT (``models.lora``): PEFT's model of
an adapter is the eager reference whichever way the program holds it. With ``export.adapters=methods`` each adapter
gets the base's methods again, ``<adapter>_<method>`` (``exporters.program.adapters``), validated here; with
``swappable`` the slots carry them (``exporters.components.slots``, which validates each and records it here).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporters.components.kind import Bundled, Finalized, Kind, Part
from exporters.config import ExportConfig, KvDType
from exporters.manifest import AdapterEntry, Manifest
from exporters.output.files import sha256_of
from exporters.program.adapters import ADAPTERS_CONSTANT, adapter_method
from exporters.program.weights import placed
from exporters.runtime.quality import full_sequence, perplexity, window_logits
from exporters.validation.methods import validate_methods
from models.lora import WEIGHTS_FILE, LoraAdapter, active_adapter, attach_adapters, check_adapter_folders, read_adapter

if TYPE_CHECKING:
    from exporters.context import ExportContext
    from exporters.context.artifacts import WrittenProgram
    from exporters.manifest import ValidationReport
    from exporters.plan import ExportPlan
    from exporters.program.lengths import Lengths
    from exporters.runtime.quality import TextWindows
    from exporters.validation.under_test import ProgramUnderTest

log = logging.getLogger("exporters")

ADAPTERS = "adapters"


@dataclass
class AdaptersRecord:
    adapters: list[LoraAdapter] = field(default_factory=list)  # load: read and attached, in model.adapters' order
    nll: dict[str, float] = field(default_factory=dict)  # baseline: the unquantized base with each applied
    validation: dict[str, ValidationReport] = field(default_factory=dict)  # validate: each adapter's methods

    def perplexity(self, adapter: str, scored: int) -> float:
        return perplexity(self.nll[adapter], scored)


class Adapters(Kind):
    name = ADAPTERS
    variant = True

    def check(self, cfg: ExportConfig, lengths: Lengths) -> None:
        check_adapter_folders(cfg.model.adapters)

    def applies(self, plan: ExportPlan) -> bool:
        return bool(plan.main.adapters)

    def load(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        model = models[part.component.name]
        record = ctx.records[part.name] = AdaptersRecord(
            [read_adapter(name, folder, model) for name, folder in part.component.build.model.adapters.items()])
        attach_adapters(model, record.adapters)

    def baseline(self, part: Part, ctx: ExportContext, models: dict[str, Any], windows: TextWindows) -> None:
        model, record = models[part.component.name], ctx.record(part.name)
        for adapter in record.adapters:  # the unquantized base with each adapter applied
            with active_adapter(model, adapter.name), model.kv_dtype_as(KvDType.fp32):
                logits = window_logits(full_sequence(model), windows)
            model.reset_cache()
            record.nll[adapter.name] = windows.nll(logits)

    def constants(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> dict[str, Any]:
        """The adapters' names, so a runner finds ``<adapter>_<method>`` from the program alone."""
        adapters = ctx.plan.methods.adapters
        return {ADAPTERS_CONSTANT: ",".join(adapters)} if adapters else {}

    def validate(self, part: Part, ctx: ExportContext, under: ProgramUnderTest, models: dict[str, Any]) -> None:
        """Each adapter's methods (export.adapters=methods) against PEFT's eager model of it."""
        record, methods = ctx.record(part.name), ctx.plan.methods
        for adapter in methods.adapters:
            record.validation[adapter] = validate_methods(
                models[part.component.name], under, methods.of_adapter(adapter), adapter,
                record.perplexity(adapter, under.text.scored_tokens))
            log.info("  validate: adapter %s %s", adapter, "passed" if record.validation[adapter].passed else "FAILED")

    def failures(self, part: Part, ctx: ExportContext) -> list[str]:
        return [f"adapter {name}'s methods: {report.describe()}"
                for name, report in ctx.record(part.name).validation.items() if not report.passed]

    def finalize(self, part: Part, ctx: ExportContext, written: WrittenProgram, pte: Path) -> Finalized:
        """The manifest's entry of each adapter: its folder and weights, what it changes, its methods, its validation,
        its data file as it will be named beside ``pte``."""
        record, entries = ctx.record(part.name), {}
        base, slots = written.methods.of_adapter(None), written.methods.slots
        quantized = ctx.quantization.adapters if ctx.quantization is not None else None
        for adapter in record.adapters:
            first = next(m for n, m in written.model.named_modules() if n.endswith(f"lora_A.{adapter.name}"))
            dtype = quantized.scheme if quantized else str(first.weight.dtype).removeprefix("torch.")
            entries[adapter.name] = AdapterEntry(
                folder=str(adapter.folder), weights_sha256=sha256_of(adapter.folder / WEIGHTS_FILE),
                rank=adapter.ranks, lora_alpha=adapter.config.lora_alpha,
                use_rslora=bool(adapter.config.use_rslora), layers=len(adapter.modules), targets=adapter.targets,
                dtype=written.model.get_submodule("lora_slots").geometry.dtype if slots else dtype,
                # swappable: the base's methods compute with it once set_adapter has set it
                methods={name: name if slots else adapter_method(adapter.name, name) for name in base},
                validation=record.validation.get(adapter.name),
                data=placed(written.adapter_data.get(adapter.name), adapter.name, pte))
        return Finalized(fields={"adapters": entries})

    def describe(self, stage: str, part: Part, ctx: ExportContext, models: dict[str, Any]) -> str:
        record = ctx.record(part.name)
        if stage == "load":
            return "".join(f"; adapter {a.describe()}" for a in record.adapters)
        if stage == "validate":
            return "".join(f"\n  adapter {name}: {v.describe()}" for name, v in record.validation.items())
        return ""

    def bundle(self, m: Manifest) -> Bundled:
        """Adapters as methods of their own (swappable ones are the slots' to describe)."""
        return Bundled(readme=bundle_readme(m)) if m.adapters and m.swappable is None else Bundled()


def bundle_readme(m: Manifest) -> str:
    """The bundle README's section on adapters as methods: each one's methods and data file, and its quality."""
    rows = "\n".join(f"| `{name}` | " + ", ".join(f"`{n}`" for n in a.methods.values()) + f" | r={'/'.join(map(str, a.rank))}, "
                     f"alpha {a.lora_alpha}{', rsLoRA' if a.use_rslora else ''}, {a.layers} layers ({', '.join(a.targets)}) | "
                     + (a.validation.quality() if a.validation else "not validated") + " |"
                     for name, a in m.adapters.items())
    first = next(iter(m.adapters))
    files = [(name, a.data) for name, a in m.adapters.items() if a.data is not None]
    data = "" if not files else (
        "Each adapter's A and B matrices are in its own data file (" + ", ".join(
            f"`{name}`: `{f.file}` {f.size_bytes / 1e6:.2f} MB" for name, f in files) + "), loaded beside the "
        f"base's `{m.data.file if m.data else ''}` to run its methods. An app ships only the adapters it uses (the "
        "base's methods need none of these files), and updates an adapter by replacing its file with one exported "
        "under the same name, ranks and targets: that export's program is the same bytes as this one.\n\n")
    return f"""## LoRA adapters

The program holds the base model's methods and, for each adapter, the same methods with the adapter applied,
named `<adapter>_<method>`; the base weights are stored once. The constant method `get_adapters` lists them
(`"{','.join(m.adapters)}"`). To switch adapters, call the other adapter's methods: they share the KV cache
with every method, so start the new conversation at position 0 (a conversation continued under another
adapter would attend to keys its adapter did not compute).

| adapter | methods | what it changes | quality |
|---|---|---|---|
{rows}

{data}`python -m exporters.generate <this folder> prompt="..." adapter={first}` runs one from Python.

"""
