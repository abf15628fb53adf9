"""Finalize: accept or reject the program (its final or ``.rejected`` name), copy the tokenizer beside it,
and write ``manifest.json``."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporters.components import parts
from exporters.context import ExportContext
from exporters.context.artifacts import ExportResult, WrittenProgram
from exporters.errors import ValidationFailed
from exporters.manifest import MANIFEST_FILE, ComponentEntry, DataFile, Manifest, ProgramFile, Resources
from exporters.output.files import private_path
from exporters.output.folder import files_of_export
from exporters.output.interrupts import held_back
from exporters.plan.footprint import MIB
from exporters.program.versions import package_versions
from exporters.program.weights import data_path_for, placed, runtime_needs
from exporters.runtime.memory import peak_rss_mb
from exporters.stages.load import opened
from exporters.stages.pipeline import Stage

if TYPE_CHECKING:
    from exporters.plan import ExportPlan

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


def failures(plan: ExportPlan, ctx: ExportContext) -> list[str]:
    """What failed validation, each part's (empty: the program is accepted)."""
    return [f for part in parts(plan) for f in part.kind.failures(part, ctx)]


def stage_files(sources: list[Path], out_dir: Path, staged: dict[Path, Path]) -> None:
    """The tokenizer's files copied beside the program under private names (final path -> that name, in
    ``staged``); a file a part already staged (a processor file it rewrote) is kept as the part wrote it."""
    for src in sources:
        if out_dir / src.name not in staged and src.parent.resolve() != out_dir.resolve():
            staged[out_dir / src.name] = private_path(out_dir / src.name, "staged")
            shutil.copy2(src, staged[out_dir / src.name])


def put_in_place(written: WrittenProgram, manifest: Manifest, pte: Path, staged: dict[Path, Path],
                 data_owners: list[str | None]) -> None:
    """The program, its data files and the staged files renamed into place together, a signal meanwhile raised
    once they are; whatever an earlier export in this folder wrote that this one does not is removed."""
    out_dir = pte.parent
    earlier = files_of_export(out_dir)
    with held_back():
        for owner in data_owners:
            data = written.data if owner is None else written.adapter_data.get(owner)
            move_data_file(written, placed(data, owner, pte), owner, pte)
        os.replace(written.path, pte)
        for final, staging in staged.items():
            os.replace(staging, final)
        for stale in earlier - manifest.files:
            (out_dir / stale).unlink(missing_ok=True)


class FinalizeStage(Stage):
    name = "finalize"
    after = ("emit",)

    def run(self, written: WrittenProgram, ctx: ExportContext) -> ExportResult:
        ckpt = ctx.checkpoint
        assert ckpt is not None and ctx.quantization is not None
        for opened_checkpoint in opened(ctx):  # the weights were read lazily until now
            opened_checkpoint.check_unchanged()
        failed = failures(self.plan, ctx)
        pte = written.final_path if not failed else rejected_path(written.final_path)
        out_dir = pte.parent
        # Everything that takes room on disk is written first, under names no reader looks at (each part's files,
        # the tokenizer's, the manifest); then the program, its data files and those are renamed into place together.
        staged: dict[Path, Path] = {}
        entries, fields = {}, {}
        for part in parts(self.plan):
            done = part.kind.finalize(part, ctx, written, pte)
            if done.entry is not None:
                entries[part.component.name] = done.entry
            fields.update(done.fields)
            staged.update(done.staged)
        manifest = self.manifest(written, ctx, pte, not failed, entries, fields)
        manifest_path = out_dir / MANIFEST_FILE
        try:
            stage_files([src for src in [*ckpt.tokenizer_files, ckpt.generation_config_file] if src is not None],
                        out_dir, staged)
            staged[manifest_path] = private_path(manifest_path, "staged")
            manifest.write(staged[manifest_path])
            put_in_place(written, manifest, pte, staged, [None, *manifest.adapters])
        finally:
            for staging in staged.values():
                staging.unlink(missing_ok=True)
        if failed:
            raise ValidationFailed(
                f"the exported program does not match the eager model: {'; '.join(failed)}. "
                f"It was kept as {pte} for inspection, not as {written.final_path.name}; details per window are in "
                f"{manifest_path}. If the difference is expected for this scheme, loosen quant.max_kl, quant.min_top1 "
                "or quant.max_ppl_drift; validate=false skips the check."
            )
        return ExportResult(pte_path=pte, manifest_path=manifest_path, manifest=manifest)

    def manifest(self, written: WrittenProgram, ctx: ExportContext, pte: Path, ok: bool,
                 entries: dict[str, ComponentEntry], fields: dict[str, Any]) -> Manifest:
        """``manifest.json`` of the program being put at ``pte``: the parts' ``entries`` and ``fields`` (the main
        model's methods, layout, constants, model and state among them) with the program's own."""
        ckpt = ctx.checkpoint
        assert ckpt is not None and ctx.quantization is not None
        data = placed(written.data, None, pte)
        own_data = {owner: data_path_for(pte, owner).name for owner in written.adapter_data}
        return Manifest(
            status="ok" if ok else "failed validation",
            program=ProgramFile(file=pte.name, size_bytes=written.size_bytes, sha256=written.sha256,
                                storage=written.storage),
            quantization=dataclasses.replace(ctx.quantization, pt2e=ctx.pt2e) if ctx.pt2e else ctx.quantization,
            validation=ctx.validation,
            tokenizer_files=[src.name for src in [*ckpt.tokenizer_files, ckpt.generation_config_file]
                             if src is not None],
            timings_s=dict(ctx.timings),  # the stages before this one
            resources=resources(ctx),
            versions=package_versions(),
            config=self.plan.resolved_config,
            data=data,
            runtime=runtime_needs(self.plan.backend.packed_once, pte.name, data.file if data else None,
                                  own_data),
            quality_warning=ctx.quality_warning,
            lowering=ctx.lowering,
            components=entries,
            **fields,  # each part's own sections of the manifest
        )
