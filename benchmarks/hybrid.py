"""Hybrid models at their published shapes (random weights): export cost, and decode speed early and late in a long
context, where a constant-size state is the point.

    python -m benchmarks.hybrid --preset lfm2-350m --out bench/hybrid-lfm2-350m --results docs/results/hybrid.json
    python -m benchmarks.hybrid --preset qwen3.5-0.8b --out bench/hybrid-qwen3.5-0.8b
    python -m benchmarks.hybrid --preset 360m --out bench/hybrid-360m    # attention only, for reference

Exports the preset (benchmarks/presets.py) with our exporter, xnnpack 8da4w, ``export.max_seq_len`` 256 and a cache of
``--context`` positions (validate=false; the tests validate these families), measuring the export's wall time and
peak RSS (os.wait4 on the child); then, in the ExecuTorch runtime: RSS after loading the program, prefill tok/s of a
64-token prompt, and decode tok/s at position 64 and at position ``--context - steps`` (the prompt fed in calls of
max_seq_len up to there; the median of ``--repeats`` rounds). Writes report.json and report.md into ``--out``. Measure
alone. ``benchmarks.export --preset lfm2-350m`` compares the export itself with ExecuTorch's export_llm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.exporting import exporter_command, run_measured
from benchmarks.long_context import fill_and_time
from benchmarks.presets import PRESETS, checkpoint_dir, exporter_overrides
from exporters.manifest import Manifest
from exporters.runtime.driver import Driver
from exporters.runtime.memory import rss_after_load_mb
from exporters.runtime.programs import LoadedProgram
from exporters.runtime.speed import time_round

# The hybrid shapes, and any other random-weight preset as the attention-only reference (360m: SmolLM2-360M's shape).
RANDOM_PRESETS = [name for name, p in PRESETS.items() if not p.real]


def keep_row(results: Path, row: dict) -> None:
    """``row`` in ``results`` (``{"rows": [...]}``), replacing an earlier one of the same preset, quant and context."""
    key = ("preset", "quant", "context")
    rows = json.loads(results.read_text())["rows"] if results.exists() else []
    rows = [r for r in rows if tuple(r[k] for k in key) != tuple(row[k] for k in key)] + [row]
    results.write_text(json.dumps({"rows": rows}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=RANDOM_PRESETS, required=True,
                    help="lfm2-350m, lfm2-1.2b, qwen3.5-0.8b; an attention-only preset (360m) as the reference")
    ap.add_argument("--quant", default="8da4w")
    ap.add_argument("--context", type=int, default=2048, help="cache positions (export.max_context_len)")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed at each position")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--results", type=Path, default=None,
                    help="also keep the row in this JSON file (one row per preset and quant: docs/results/hybrid.json, "
                         "which docs/hybrid.md's table is generated from by python -m benchmarks.tables)")
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_hybrid_"))
    out.mkdir(parents=True, exist_ok=True)
    hf_dir = checkpoint_dir(preset, out)
    run = out / "ours"
    print(f"exporting {args.preset} ({preset.describe()}) ...", flush=True)
    wall, peak_mb = run_measured(exporter_command(
        [*exporter_overrides(preset, hf_dir), f"quant={args.quant}", f"export.max_seq_len={args.max_seq_len}",
         f"export.max_context_len={args.context}", "validate=false"], run), out / "export.log")
    manifest = Manifest.read(run / "manifest.json")
    pte = run / manifest.program.file
    methods = list(manifest.methods)
    rss_mb = rss_after_load_mb(pte, methods)
    driver = Driver.of(LoadedProgram(pte))
    driver.load()
    late = args.context - args.steps
    rates: dict[str, list[float]] = {"prefill_64": [], "decode_at_64": [], f"decode_at_{late}": []}
    for r in range(args.repeats + 1):  # round 0 warms up
        prompt = torch.randint(0, preset.vocab, (1, 64), generator=torch.Generator().manual_seed(r))
        prefill_s, decode_s = time_round(driver, prompt, args.steps)
        got = {"prefill_64": 64 / prefill_s, "decode_at_64": args.steps / decode_s,
               f"decode_at_{late}": fill_and_time(driver, args.context, args.steps, preset.vocab, r)}
        if r:
            for key, value in got.items():
                rates[key].append(value)
    kv = manifest.kv_cache
    assert kv is not None
    row = {"preset": args.preset, "parameters_m": round(preset.parameters / 1e6, 1), "quant": args.quant,
           "context": args.context, "max_seq_len": args.max_seq_len, "export_s": round(wall, 1),
           "peak_rss_gb": round(peak_mb / 1024, 2), "pte_mb": round(manifest.program.size_bytes / 1e6, 1),
           "kv_cache_mb": round(kv.bytes / 1e6, 1), "state_mb": round(kv.state_bytes / 1e6, 1),
           "rss_after_load_mb": rss_mb, **{f"{k}_tok_s": round(statistics.median(v), 1) for k, v in rates.items()}}
    (out / "report.json").write_text(json.dumps(row, indent=2))
    if args.results is not None:
        keep_row(args.results, row)
    keys = [k for k in row if k != "preset"]
    table = (f"| {' | '.join(['preset', *keys])} |\n|{'---|' * (len(keys) + 1)}\n"
             f"| {' | '.join(str(row[k]) for k in ['preset', *keys])} |\n")
    (out / "report.md").write_text(table)
    print(table)
    print(f"report: {out / 'report.json'}, {out / 'report.md'}")


if __name__ == "__main__":
    main()
