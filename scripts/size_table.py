"""Size of the 134M-parameter Llama (random weights) on XNNPACK for each quant option.

    python scripts/size_table.py [--quants fp32 8da4w ...] [--one-method fp32 8da4w]

For every quant option: the .pte size with prefill + decode; for the options in --one-method also
decode alone, giving the two-method / one-method ratio (weights are stored once, so it is ~1.00).
Each export is validated in the runtime as usual. Prints a Markdown table and writes sizes.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_export import PRESETS  # the 134M preset is defined once, there

from exporters.manifest import Manifest

ARCH = [*PRESETS["134m"].arch_overrides(), "export.max_seq_len=256", "backend=xnnpack",
        "export.methods=[prefill,decode]", "export.layout=split"]


def export_size(out: Path, *overrides: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "exporters.llm", *ARCH, *overrides, f"hydra.run.dir={out}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-800:]}
    m = Manifest.read(out)
    return {"bytes": m.program.size_bytes, "validation_max_rel_error": m.validation.max_rel_error if m.validation else None,
            "lower_s": m.timings_s["lower"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quants", nargs="+", default=["fp32", "fp16", "bf16", "8da8w", "8da4w", "8da4w_emb4w"])
    ap.add_argument("--one-method", nargs="*", default=["fp32", "8da4w"])
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="size_table_")))
    args = ap.parse_args()
    rows = {}
    for quant in args.quants:
        row = {"two_methods": export_size(args.out / quant / "both", f"quant={quant}")}
        if quant in args.one_method:
            row["decode_only"] = export_size(args.out / quant / "one", f"quant={quant}", "export.methods=[decode]")
        rows[quant] = row
        print(quant, json.dumps(row), flush=True)
    (args.out / "sizes.json").write_text(json.dumps(rows, indent=2))
    print("\n| quant | prefill+decode MB | decode only MB | ratio | max rel err (runtime vs eager) |")
    print("|---|---|---|---|---|")
    for quant, row in rows.items():
        both, one = row["two_methods"], row.get("decode_only", {})
        if "error" in both:
            print(f"| {quant} | failed: see sizes.json | | | |")
            continue
        ratio = f"{both['bytes'] / one['bytes']:.4f}" if one.get("bytes") else ""
        one_mb = f"{one['bytes'] / 1e6:.1f}" if one.get("bytes") else ""
        print(f"| {quant} | {both['bytes'] / 1e6:.1f} | {one_mb} | {ratio} | {both['validation_max_rel_error']:.2g} |")


if __name__ == "__main__":
    main()
