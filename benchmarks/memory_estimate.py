"""The memory estimate against the measured peak: every benchmark preset exported as a user would, one at a time.

    python -m benchmarks.memory_estimate --out docs/results/memory-estimate.json          # every run (about 70 min)
    python -m benchmarks.memory_estimate --runs 134m smollm2 --out /tmp/mem.json          # some of them

Each run is ``python -m exporters.llm`` in a child process with the CLI's defaults (validation and, past the quality
warning, advise included) on one preset of ``benchmarks/presets.py`` with the quant its benchmarks use, plus SmolLM2
past the quality warning (advise measures its remedies, GPTQ's among them) and under the other schemes whose memory
differs (a calibrated algorithm, rotations, fp32). The measured peak is the
child's (``os.wait4``: what the kernel's out-of-memory killer sees); the estimate is the one the load stage printed
and the manifest recorded (``resources.estimated_peak_rss_mb``), each stage's beside it. The load stage refuses an
export by this estimate, so ``tests/test_footprint.py`` holds it within 15% of every peak measured here; the table
in docs/performance.md is rendered from the JSON (``python -m benchmarks.tables``). Run it alone: the peaks do not
depend on the CPU's load, but two exports at once may not fit.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.exporting import exporter_command, run_measured
from benchmarks.presets import PRESETS, REAL_WEIGHTS, preset_overrides

MIB = 2**20
TOLERANCE = 0.15  # the estimate must hold the measured peak within this (issue 47)


@dataclass(frozen=True)
class Run:
    """One export: a preset under a quant option, plus overrides. ``first_load``: from the preset's GGUF file itself
    with an empty cache (its conversion is part of the export); ``draft``: a real checkpoint's GGUF as the draft."""

    preset: str
    quant: str
    overrides: tuple[str, ...] = ()
    first_load: bool = False
    draft: str | None = None  # a key of REAL_WEIGHTS

    @property
    def name(self) -> str:
        return " ".join([self.preset, self.quant, *self.overrides, *(["first-load"] if self.first_load else []),
                         *([f"draft={self.draft}"] if self.draft else [])])

    @property
    def weights(self) -> list[str]:
        """The real checkpoints it reads."""
        return [w for w in (PRESETS[self.preset].weights, self.draft) if w is not None]

    def exporter_overrides(self, root: Path) -> list[str]:
        """The CLI overrides of this run, its checkpoint folder written under ``root`` (or its GGUF file's path)."""
        preset = PRESETS[self.preset]
        model = ([f"model={preset.family}", f"model.checkpoint={self.gguf_files()[0]}"] if self.first_load
                 else preset_overrides(preset, root / self.preset))
        draft = [f"draft.checkpoint={REAL_WEIGHTS[self.draft].gguf()}"] if self.draft else []
        return [*model, *draft, f"quant={self.quant}", *self.overrides]

    def gguf_files(self) -> list[Path]:
        """The GGUF files its export converts on first use (with ``first_load``)."""
        return [REAL_WEIGHTS[w].gguf() for w in self.weights] if self.first_load else []


# Every benchmark preset with the quant its benchmarks use (docs/performance.md), then SmolLM2 (real weights) under
# the schemes that hold memory differently: GPTQ calibrates on the model cast whole, rotations turn it whole, fp32
# keeps every weight in its dtype.
RUNS = (
    Run("tiny", "8da4w"),
    Run("134m", "8da4w"),
    Run("smollm2", "8da4w"),
    Run("271m", "8da4w"),
    Run("360m", "8da4w"),
    Run("1b", "8da4w_emb4w"),
    Run("3b", "8da4w_emb4w"),
    Run("qwen3-4b", "8da4w_emb4w"),
    Run("8b", "8da4w_emb4w"),
    Run("smollm2", "8da4w", ("validation.warn_ppl_increase=0.1",)),  # past the warning: advise measures remedies
    Run("smollm2", "8da4w_calibrated"),
    Run("smollm2", "8da4w_rotated"),
    Run("smollm2", "fp32"),
    # A GGUF file's first use (transformers dequantizes it), alone and as a target with its draft (issue 65).
    Run("smollm2", "8da4w", first_load=True),
    Run("qwen2.5-coder-1.5b", "8da4w", ("export.max_seq_len=256", "export.max_context_len=1024"), first_load=True,
        draft="qwen2.5-coder-0.5b"),
)


def estimated_stages(run: Run, root: Path) -> dict[str, float]:
    """Each stage's estimated peak (MiB) for ``run``'s export, as the load stage computes it (advise's too, when
    validation may set it off; load's with the GGUF conversions of a first load, whether or not this machine's cache
    holds them now)."""
    from exporters.components.resolve import plan_export
    from exporters.config import compose
    from exporters.stages.load import planned_footprint
    from models.gguf import gguf_tensors

    with tempfile.TemporaryDirectory() as tmp:
        footprint = planned_footprint(plan_export(compose(*run.exporter_overrides(root))), Path(tmp))
    for file in run.gguf_files():
        footprint = footprint.first_converting(gguf_tensors(file))
    stages = {stage: round(b / MIB) for stage, b in footprint.stages.items()}
    if footprint.advise is not None:
        stages["advise"] = round(footprint.advise / MIB)
    return stages


def with_estimate(row: dict, run: Run, root: Path) -> dict:
    """``row`` (a measured run) with this code's estimate of its peak: the largest stage's, advise's counted only when
    advise ran (as the manifest's ``estimated_peak_rss_mb``)."""
    stages = estimated_stages(run, root)
    counted = {stage: mb for stage, mb in stages.items() if stage != "advise" or row["advised"]}
    stage = max(counted, key=counted.__getitem__)
    estimated = counted[stage]
    return {**row, "estimated_mb": estimated, "estimated_stage": stage,
            "error": round(estimated / row["peak_mb"] - 1, 3), "estimated_stages_mb": stages}


def measure(run: Run, work: Path) -> dict:
    """Export ``run`` in a child process; its measured peak beside the manifest's estimate."""
    from exporters.manifest import MANIFEST_FILE, Manifest

    overrides = run.exporter_overrides(work)
    out = work / run.name.replace(" ", "_").replace("=", "-")
    cache = {"LLM_EXPORTERS_CACHE": str(out / "cache")} if run.first_load else None  # nothing converted yet
    wall, peak_mb = run_measured(exporter_command(overrides, out), out / "export.log", cache)
    manifest = Manifest.read(out / MANIFEST_FILE)
    row = {"run": run.name, "preset": run.preset, "quant": run.quant, "overrides": list(run.overrides),
           "wall_s": round(wall, 1), "peak_mb": round(peak_mb), "peak_stage": manifest.resources.peak_stage,
           "advised": manifest.quality_warning is not None}
    row = with_estimate(row, run, work)
    if manifest.resources.estimated_peak_rss_mb != row["estimated_mb"]:
        print(f"  (the export estimated {manifest.resources.estimated_peak_rss_mb} MB: exporters/plan/footprint.py changed "
              "while this ran; the row has this process's estimate)", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="*", default=None, metavar="PRESET",
                    help="only the runs of these presets, or of these names (\"smollm2 fp32\"; default: all of them)")
    ap.add_argument("--work", type=Path, default=None, help="where the exports go (default: a temporary folder)")
    ap.add_argument("--out", type=Path, required=True, help="the JSON report (rows are kept as each run finishes)")
    ap.add_argument("--refresh-estimates", action="store_true",
                    help="measure nothing: write this code's estimate into every row of --out (after a change to "
                         "exporters/plan/footprint.py; tests/test_footprint.py checks the rows hold the current estimate)")
    args = ap.parse_args()
    if args.refresh_estimates:
        runs_by_name = {r.name: r for r in RUNS}
        report = json.loads(args.out.read_text())
        with tempfile.TemporaryDirectory() as tmp:
            report["rows"] = [with_estimate(row, runs_by_name[row["run"]], Path(tmp)) for row in report["rows"]]
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        for r in report["rows"]:
            print(f"{r['run']}: peak {r['peak_mb']} MB, estimated {r['estimated_mb']} MB: {r['error']:+.1%}")
        return
    runs = [r for r in RUNS if args.runs is None or r.preset in args.runs or r.name in args.runs]
    work = args.work or Path(tempfile.mkdtemp(prefix="memory_estimate_"))
    # Rows of runs measured before are kept (a run measured again replaces its row), in the order of RUNS.
    rows = {r["run"]: r for r in json.loads(args.out.read_text())["rows"]} if args.out.exists() else {}
    for run in runs:
        print(f"{run.name} ...", flush=True)
        r = rows[run.name] = measure(run, work)
        print(f"  peak {r['peak_mb']} MB (in {r['peak_stage']}), estimated {r['estimated_mb']} MB "
              f"(in {r['estimated_stage']}): {r['error']:+.1%}, {r['wall_s']:.0f} s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        ordered = [rows[n] for n in [r.name for r in RUNS] + sorted(rows) if n in rows]
        args.out.write_text(json.dumps({"tolerance": TOLERANCE, "rows": list({r["run"]: r for r in ordered}.values())},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
