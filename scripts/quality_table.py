"""Validation measures and perplexity of every quant option a backend runs, on the real SmolLM2-135M.

    python scripts/quality_table.py                      # first 2 layers (what the tests use), xnnpack + portable
    python scripts/quality_table.py export.max_seq_len=256 --layers 30 --backends xnnpack --quants 8da4w

Each row is a real export through the CLI (`python -m exporters.llm`), validated as usual; the numbers
come from its manifest whether validation passed or not. This is how the tolerances in
``conf/quant/*.yaml`` were calibrated. Prints a Markdown table and writes ``<out>/quality.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporters.manifest import MANIFEST_FILE, Manifest  # noqa: E402
from models.gguf import gguf_checkpoint  # noqa: E402
from models.smollm2 import gguf_file, truncated_copy  # noqa: E402

OPTIONS = {
    "xnnpack": [["quant=fp32"], ["quant=fp16"], ["quant=bf16"], ["quant=8da8w"], ["quant=8da4w"],
                ["quant=8da4w_emb4w"], ["quant=8da4w", "quant.embedding=8w"]],
    "portable": [["quant=fp32"], ["quant=fp16"], ["quant=bf16"], ["quant=fp32", "quant.embedding=4w"],
                 ["quant=fp32", "quant.embedding=8w"]],
}


def label(overrides: list[str]) -> str:
    """``["quant=fp32", "quant.embedding=4w"]`` -> ``fp32 quant.embedding=4w``."""
    return " ".join(o.removeprefix("quant=") for o in overrides)


def run(checkpoint: Path, out: Path, backend: str, overrides: list[str], extra: list[str]) -> dict:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "exporters.llm", "model=llama", f"model.checkpoint={checkpoint}",
                           f"backend={backend}", *overrides, *extra, f"hydra.run.dir={out}"],
                          capture_output=True, text=True)
    row = {"backend": backend, "options": label(overrides),
           "wall_s": round(time.perf_counter() - t, 1)}
    if not (out / MANIFEST_FILE).exists():
        return {**row, "error": (proc.stdout + proc.stderr)[-600:]}
    m = Manifest.read(out)
    v = m.validation
    assert v is not None  # this script always validates
    return {**row, "passed": v.passed, "failures": v.failures, "kl_mean": v.kl_mean, "kl_max": v.kl_max,
            "top1": v.top1_agreement, "top5": v.top5_overlap, "max_abs_error": v.max_abs_error,
            "ppl": v.perplexity, "ppl_eager": v.eager_perplexity, "ppl_ref": v.reference_perplexity,
            "forward_kl": v.forward_kl, "mb": m.program.size_bytes / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers kept (30 = the whole model)")
    ap.add_argument("--backends", nargs="+", default=list(OPTIONS))
    ap.add_argument("--quants", nargs="*", help="only these rows (e.g. 8da4w fp32 'fp32 quant.embedding=4w')")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="quality_table_")))
    ap.add_argument("extra", nargs="*", help="more CLI overrides for every export (e.g. export.max_seq_len=256)")
    args = ap.parse_args()

    full = gguf_checkpoint(gguf_file())
    ckpt = full if args.layers >= 30 else truncated_copy(full, args.out / f"smollm2-{args.layers}l", args.layers)
    rows = []
    for backend in args.backends:
        for overrides in OPTIONS[backend]:
            if args.quants and label(overrides) not in args.quants:
                continue
            name = "-".join(o.replace("quant=", "").replace("quant.", "").replace("=", "") for o in overrides)
            rows.append(run(ckpt, args.out / f"{backend}-{name}", backend, overrides, args.extra))
            print(json.dumps(rows[-1]), flush=True)
    (args.out / "quality.json").write_text(json.dumps(rows, indent=2))
    print(f"\nSmolLM2-135M, {args.layers} layers ({' '.join(args.extra) or 'default settings'})\n")
    print("| backend | quant | passed | KL mean | KL max | top-1 | top-5 | ppl program | ppl eager | ppl fp32 | MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['backend']} | {r['options']} | error | | | | | | | | |")
            continue
        print(f"| {r['backend']} | {r['options']} | {'yes' if r['passed'] else 'NO'} | {r['kl_mean']:.2g} | "
              f"{r['kl_max']:.2g} | {r['top1']:.1%} | {r['top5']:.1%} | {r['ppl']:.2f} | {r['ppl_eager']:.2f} | "
              f"{r['ppl_ref']:.2f} | {r['mb']:.1f} |")
    print(f"\nmanifests under {args.out}")


if __name__ == "__main__":
    main()
