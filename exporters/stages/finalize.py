"""Finalize: accept or reject the program (its final or ``.rejected`` name), copy the tokenizer beside it,
and write ``manifest.json``."""

from __future__ import annotations

import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

from exporters.stages.artifacts import ExportResult, ValidatedProgram
from exporters.runtime.memory import peak_rss_mb
from exporters.runtime.driver import MethodRoles
from exporters.errors import ValidationFailed
from exporters.program.layouts import Layout, layout_manifest
from exporters.manifest import MANIFEST_FILE, Manifest, MethodEntry, ModelEntry, ProgramFile, Resources
from exporters.stages.pipeline import Stage

PACKAGES = ("torch", "executorch", "torchao", "transformers", "hydra-core", "tokenizers", "safetensors")


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def rejected_path(final: Path) -> Path:
    return final.with_name(final.stem + ".rejected" + final.suffix)


class FinalizeStage(Stage):
    name = "finalize"

    def __init__(self, resolved_config: dict[str, Any], timings: dict[str, float], layout: Layout) -> None:
        self.layout = layout
        self.resolved_config = resolved_config
        self.timings = timings

    def run(self, validated: ValidatedProgram) -> ExportResult:
        emitted = validated.emitted
        report = validated.report
        # The config check refused method sets where nothing takes one token, so there always are roles.
        roles = MethodRoles.choose({n: spec.shape for n, spec in emitted.specs.items()})
        ok = report is None or report.passed
        pte = emitted.final_path if ok else rejected_path(emitted.final_path)
        os.replace(emitted.path, pte)
        out_dir = pte.parent
        ckpt = emitted.quantized.loaded.checkpoint
        copied = []
        for src in [*ckpt.tokenizer_files, ckpt.generation_config_file]:
            if src is not None and src.parent.resolve() != out_dir.resolve():
                shutil.copy2(src, out_dir / src.name)
            if src is not None:
                copied.append(src.name)
        manifest = Manifest(
            status="ok" if ok else "failed validation",
            program=ProgramFile(file=pte.name, size_bytes=emitted.size_bytes, sha256=emitted.sha256,
                                storage=emitted.storage),
            methods={
                name: MethodEntry(inputs=emitted.signatures[name].inputs, outputs=emitted.signatures[name].outputs,
                                  dynamic_tokens=spec.dynamic,
                                  tokens=[spec.min_tokens, spec.max_tokens],
                                  delegated_partitions=emitted.delegated_partitions.get(name, 0),
                                  lowered_once_with=emitted.aliases.get(name))
                for name, spec in emitted.specs.items()
            },
            layout=layout_manifest(self.layout, {name: spec.kind for name, spec in emitted.specs.items()},
                                   roles.prompt, roles.step,
                                   all(spec.dynamic for spec in emitted.specs.values() if spec.kind != "decode")),
            constant_methods=emitted.constant_methods,
            model=ModelEntry(checkpoint=str(ckpt.path), architecture=list(ckpt.hf_config.architectures or []),
                             family=emitted.quantized.loaded.family,
                             attention=emitted.quantized.model.args.attention,
                             parameters=sum(p.numel() for p in emitted.quantized.model.parameters()),
                             converted_from=ckpt.converted_from),
            quantization=emitted.quantized.quantization,
            validation=report,
            tokenizer_files=copied,
            timings_s=self.timings,
            resources=Resources(wall_s=round(sum(self.timings.values()), 1), peak_rss_mb=round(peak_rss_mb())),
            versions=package_versions(),
            config=self.resolved_config,
        )
        manifest_path = out_dir / MANIFEST_FILE
        manifest.write(manifest_path)
        if not ok:
            assert report is not None
            raise ValidationFailed(
                f"the exported program does not match the eager model: {report.describe()}. "
                f"It was kept as {pte} for inspection, not as {emitted.final_path.name}; details per window are in "
                f"{manifest_path}. If the difference is expected for this scheme, loosen quant.max_kl, quant.min_top1 "
                "or quant.max_ppl_increase; validate=false skips the check."
            )
        return ExportResult(pte_path=pte, manifest_path=manifest_path, manifest=manifest)
