"""Finalize: accept or reject the program (its final or ``.rejected`` name), copy the tokenizer beside it,
and write ``manifest.json``."""

from __future__ import annotations

import dataclasses
import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporters.errors import ValidationFailed
from exporters.interrupts import held_back
from exporters.footprint import MIB
from exporters.internals import write_tensor_file
from exporters.manifest import (MANIFEST_FILE, AdapterEntry, ComponentEntry, DataFile, HeadVocabularyEntry, Manifest,
                                MethodEntry, ModelEntry, ProgramFile, Resources, SwappableEntry)
from exporters.program.adapters import adapter_method
from exporters.program.cache import kv_cache_entry
from exporters.program.constants import recorded
from exporters.program.files import private_path, sha256_of
from exporters.program.layouts import layout_manifest
from exporters.program.swappable import SWAP_HOWTO, adapter_file
from exporters.program.weights import data_path_for, runtime_needs
from exporters.program.vision import vision_entry
from exporters.plan.component import ComponentKind
from exporters.runtime.driver import MethodRoles
from exporters.run_folder import files_of_export
from exporters.runtime.memory import peak_rss_mb
from exporters.stages.artifacts import ExportResult, WrittenProgram
from exporters.stages.pipeline import ExportContext, Stage
from models.families import family_of_config
from models.lora import WEIGHTS_FILE
from models.lora_slots import SET_ADAPTER

if TYPE_CHECKING:
    from exporters.plan import ExportPlan
    from exporters.plan.component import Component
    from exporters.stages.artifacts import BaselineQuality

PACKAGES = ("torch", "executorch", "torchao", "transformers", "hydra-core", "tokenizers", "safetensors")


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def adapter_entries(ctx: ExportContext, written: WrittenProgram) -> dict[str, AdapterEntry]:
    """The manifest's entry of each adapter: its folder and weights, what it changes, its methods, its validation."""
    entries = {}
    base = written.methods.of_adapter(None)
    slots = written.methods.slots
    for adapter in ctx.adapters:
        first = next(m for n, m in written.model.named_modules() if n.endswith(f"lora_A.{adapter.name}"))
        dtype = (ctx.quantization.adapters.scheme if ctx.quantization and ctx.quantization.adapters
                 else str(first.weight.dtype).removeprefix("torch."))
        entries[adapter.name] = AdapterEntry(
            folder=str(adapter.folder), weights_sha256=sha256_of(adapter.folder / WEIGHTS_FILE),
            rank=adapter.ranks, lora_alpha=adapter.config.lora_alpha,
            use_rslora=bool(adapter.config.use_rslora), layers=len(adapter.modules), targets=adapter.targets,
            dtype=written.model.get_submodule("lora_slots").geometry.dtype if slots else dtype,
            # swappable: the base's methods compute with it once set_adapter has set it
            methods={name: name if slots else adapter_method(adapter.name, name) for name in base},
            validation=ctx.adapter_validation.get(adapter.name))
    return entries


def component_entries(plan: ExportPlan, ctx: ExportContext, written: WrittenProgram,
                      parameters: int) -> dict[str, ComponentEntry]:
    """Each model the program holds: the decoder (its quantization and validation are the manifest's own), then the
    others with theirs."""
    assert ctx.checkpoint is not None
    entries = {}
    for component in plan.components:
        if component.kind == ComponentKind.vision_encoder:
            encoder = written.components[component.name]
            entries[component.name] = ComponentEntry(
                kind=str(component.kind), methods=list(written.methods.of_component(component.name)), adapters=[],
                checkpoint=str(ctx.checkpoint.path), parameters=sum(p.numel() for p in encoder.parameters()),
                state=[], vision=vision_entry(component, ctx.checkpoint, ctx.vision_quantization, ctx.vision_check))
            continue
        if component.is_decoder:
            methods = [n for n in written.methods.specs if n not in written.methods.component_of]
            entries[component.name] = ComponentEntry(
                kind=str(component.kind), methods=methods, adapters=component.adapters,
                checkpoint=str(ctx.checkpoint.path), parameters=parameters, state=["kv_cache"])
            continue
        model, checkpoint = written.components[component.name], ctx.component_checkpoints[component.name]
        family = family_of_config(checkpoint.hf_config)
        entries[component.name] = ComponentEntry(
            kind=str(component.kind), methods=list(written.methods.of_component(component.name)), adapters=[],
            checkpoint=str(checkpoint.path), parameters=model.parameter_count(),
            state=["kv_cache"], quantization=ctx.component_quantization.get(component.name),
            validation=ctx.component_validation.get(component.name), family=family.name if family else None,
            vocabulary=head_vocabulary(component, ctx.baseline))
    return entries


def head_vocabulary(component: Component, baseline: BaselineQuality | None) -> HeadVocabularyEntry | None:
    """What a restricted head scores (draft.vocab), and how much of the validation text that is (the targets the
    baseline scored it on)."""
    head = component.build.head
    if head is None:
        return None
    coverage = (round(baseline.component_tokens[component.name] / baseline.text.scored_tokens, 4)
                if baseline is not None else None)
    return HeadVocabularyEntry(tokens=head.size, ranked_by=head.ranked_by or "tokenizer order", coverage=coverage)


def placed(data: DataFile | None, adapter: str | None, pte: Path) -> DataFile | None:
    """The data file of the base (or of ``adapter``) as it will be named beside ``pte``."""
    return None if data is None else dataclasses.replace(data, file=data_path_for(pte, adapter).name)


def move_data_file(written: WrittenProgram, data: DataFile | None, adapter: str | None, pte: Path) -> None:
    """The data file of the base (or of ``adapter``) renamed from emit's provisional name to ``data``'s; without one,
    a file of that name left by an earlier export (it belonged to the program being replaced) is removed."""
    path = data_path_for(pte, adapter)
    if data is None:
        path.unlink(missing_ok=True)
        return
    os.replace(data_path_for(written.path, adapter), path)


def resources(ctx: ExportContext) -> Resources:
    """The export's wall time and peak RSS (every stage so far), the stage it was reached in, and the load stage's
    estimate of it (with advise's remedies when advise ran)."""
    peak = round(max([peak_rss_mb(), *ctx.peak_rss_mb.values()]))
    stage = next((s for s, mb in ctx.peak_rss_mb.items() if mb >= peak - 1), None)
    estimated = estimated_stage = None
    if ctx.footprint is not None:
        estimated, estimated_stage = ctx.footprint.peak, ctx.footprint.peak_stage
        # Advise measures its remedies only past the quality warning (the warning is what it found).
        if ctx.quality_warning is not None and ctx.footprint.advise is not None and ctx.footprint.advise > estimated:
            estimated, estimated_stage = ctx.footprint.advise, "advise"
        estimated = round(estimated / MIB)
    return Resources(wall_s=round(sum(ctx.timings.values()), 1), peak_rss_mb=peak, peak_stage=stage,
                     estimated_peak_rss_mb=estimated, estimated_peak_stage=estimated_stage)


def rejected_path(final: Path) -> Path:
    return final.with_name(final.stem + ".rejected" + final.suffix)


class FinalizeStage(Stage):
    name = "finalize"
    after = ("emit",)

    def run(self, written: WrittenProgram, ctx: ExportContext) -> ExportResult:
        report, ckpt, model = ctx.validation, ctx.checkpoint, written.model
        assert ckpt is not None and ctx.quantization is not None
        for opened in (ckpt, *ctx.component_checkpoints.values()):  # the weights were read lazily until now
            opened.check_unchanged()
        specs, base = written.methods.specs, written.methods.of_adapter(None)
        # The config check refused method sets where nothing takes one token, so there always are roles.
        roles = MethodRoles.choose({n: spec.shape for n, spec in base.items()})
        adapters = adapter_entries(ctx, written)
        failed = [name for name, a in adapters.items() if a.validation is not None and not a.validation.passed]
        failed_components = [name for name, v in ctx.component_validation.items() if not v.passed]
        image_failed = ctx.vision_check is not None and not ctx.vision_check.passed
        ok = (report is None or report.passed) and not failed and not failed_components and not image_failed
        pte = written.final_path if ok else rejected_path(written.final_path)
        out_dir = pte.parent
        # Everything that takes room on disk is written first, under names no reader looks at (the tokenizer's files,
        # the manifest); then the program, its data files and those are renamed into place together, a signal
        # meanwhile raised once they are, and whatever an earlier export in this folder wrote that this one does not
        # is removed: the folder holds one export, never a mix of two.
        data = placed(written.data, None, pte)
        for name, entry in adapters.items():
            entry.data = placed(written.adapter_data.get(name), name, pte)
        swappable, adapter_files = self.swappable_entry(written, ctx, out_dir)
        sources = [src for src in [*ckpt.tokenizer_files, ckpt.generation_config_file] if src is not None]
        copied = [src.name for src in sources]
        family = family_of_config(ckpt.hf_config)
        parameters = model.parameter_count()
        timings = dict(ctx.timings)  # the stages before this one
        manifest = Manifest(
            status="ok" if ok else "failed validation",
            program=ProgramFile(file=pte.name, size_bytes=written.size_bytes, sha256=written.sha256,
                                storage=written.storage),
            methods={
                name: MethodEntry(inputs=written.methods.signatures[name].inputs,
                                  outputs=written.methods.signatures[name].outputs,
                                  dynamic_tokens=spec.dynamic,
                                  tokens=[spec.min_tokens, spec.max_tokens],
                                  delegated_partitions=written.delegated_partitions.get(name, 0),
                                  lowered_once_with=written.methods.aliases.get(name))
                for name, spec in specs.items()
            },
            layout=layout_manifest(self.plan.layout, {name: spec.kind for name, spec in base.items()},
                                   roles.prompt, roles.step,
                                   all(spec.dynamic for spec in base.values() if spec.kind in ("prefill", "forward")),
                                   slides=written.constant_methods["get_max_seq_len"] <
                                   written.constant_methods["get_max_context_len"],
                                   sink=model.args.attention_sink > 0),
            constant_methods=recorded(written.constant_methods),
            model=ModelEntry(checkpoint=str(ckpt.path), architecture=list(ckpt.hf_config.architectures or []),
                             family=family.name if family else None,
                             attention=str(model.args.attention),
                             parameters=parameters,
                             converted_from=ckpt.converted_from),
            quantization=dataclasses.replace(ctx.quantization, pt2e=ctx.pt2e) if ctx.pt2e else ctx.quantization,
            validation=report,
            tokenizer_files=copied,
            timings_s=timings,
            resources=resources(ctx),
            versions=package_versions(),
            config=self.plan.resolved_config,
            data=data,
            runtime=runtime_needs(self.plan.backend.name, pte.name, data.file if data else None,
                                  {n: a.data.file for n, a in adapters.items() if a.data is not None}),
            adapters=adapters,
            quality_warning=ctx.quality_warning,
            kv_cache=kv_cache_entry(model, max(spec.max_tokens for spec in base.values())),
            components=component_entries(self.plan, ctx, written, parameters),
            swappable=swappable,
        )
        manifest_path = out_dir / MANIFEST_FILE
        staged: dict[Path, Path] = dict(adapter_files)  # final path -> where it is written first
        try:
            for src in sources:
                if src.parent.resolve() != out_dir.resolve():
                    staged[out_dir / src.name] = private_path(out_dir / src.name, "staged")
                    shutil.copy2(src, staged[out_dir / src.name])
            staged[manifest_path] = private_path(manifest_path, "staged")
            manifest.write(staged[manifest_path])
            earlier = files_of_export(out_dir)
            with held_back():
                for owner, entry_data in [(None, data), *((n, a.data) for n, a in adapters.items())]:
                    move_data_file(written, entry_data, owner, pte)
                os.replace(written.path, pte)
                for final, staging in staged.items():
                    os.replace(staging, final)
                for stale in earlier - manifest.files:
                    (out_dir / stale).unlink(missing_ok=True)
        finally:
            for staging in staged.values():
                staging.unlink(missing_ok=True)
        if not ok:
            what = report.describe() if report is not None and not report.passed else ""
            what += "".join(f"; adapter {n}'s methods: {adapters[n].validation.describe()}"  # type: ignore[union-attr]
                            for n in failed)
            what += "".join(f"; the {n}'s methods: {ctx.component_validation[n].describe()}" for n in failed_components)
            what += f"; the image path: {', '.join(ctx.vision_check.failures)}" if image_failed else ""  # type: ignore[union-attr]
            raise ValidationFailed(
                f"the exported program does not match the eager model: {what.removeprefix('; ')}. "
                f"It was kept as {pte} for inspection, not as {written.final_path.name}; details per window are in "
                f"{manifest_path}. If the difference is expected for this scheme, loosen quant.max_kl, quant.min_top1 "
                "or quant.max_ppl_drift; validate=false skips the check."
            )
        return ExportResult(pte_path=pte, manifest_path=manifest_path, manifest=manifest)

    def swappable_entry(self, written: WrittenProgram, ctx: ExportContext,
                        out_dir: Path) -> tuple[SwappableEntry | None, dict[Path, Path]]:
        """export.adapters=swappable: the manifest's record of the slots, and each adapter given written as
        ``adapters/<name>.ptd`` under a private name (final path -> that name), renamed into place with the rest."""
        if written.methods.slots is None:
            return None, {}
        geometry = written.model.get_submodule("lora_slots").geometry
        staged, files = {}, {}
        for name, tensors in ctx.packed_adapters.items():
            final = adapter_file(out_dir, name)
            final.parent.mkdir(exist_ok=True)
            staged[final] = private_path(final, "staged")
            write_tensor_file(tensors, staged[final])
            files[name] = DataFile(file=str(final.relative_to(out_dir)), size_bytes=staged[final].stat().st_size,
                                   sha256=sha256_of(staged[final]), entries=len(tensors))
        entry = SwappableEntry(method=SET_ADAPTER, inputs=written.methods.signatures[SET_ADAPTER].inputs,
                               slots=geometry.to_json(), adapters=files, how=SWAP_HOWTO)
        return entry, staged
