"""Our export of a vision-language shape beside optimum-executorch's, in one run, each alone in a child process.

    python -m benchmarks.vision_peers gemma3-4b --optimum-python /path/to/optimum-venv/bin/python \
        --out bench/vision-peers

Both export the same published shape (``benchmarks.vision_shapes``) with seeded random weights: ours builds them
(``model.random_init=true``), optimum-executorch 1.1 reads them from a checkpoint this writes first (transformers'
own class of the shape, bf16 safetensors as the shape is published). Both: xnnpack, the decoder's linear layers 8da4w
in groups of 32, the embedding 4-bit, the vision encoder's linear layers 8da8w, the same ``max_seq_len``. Ours
validates its program in the runtime as it always does (its time is in ours); optimum-executorch validates nothing.
For each: wall time, peak RSS, the program's size, or how it failed (killed by the kernel's OOM killer, say); for a
program of ours also ``benchmarks.vision``'s runtime numbers. Writes ``report.json`` into ``--out``.

optimum-executorch 1.1 pins transformers 5.0.0rc1, so it runs from a venv of its own (docs/performance.md says how to
make one; ``--optimum-python``).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.exporting import exporter_command, run_measured_or_failed
from benchmarks.vision_shapes import SHAPES, write_shape

# The same schemes for both exporters: ours as overrides, optimum-executorch's CLI spelling of them.
OURS = ["quant=8da4w_emb4w", "quant.group_size=32", "quant.embedding_group_size=32", "quant.vision=8da8w"]
OPTIMUM = ["--qlinear", "8da4w", "--qlinear_group_size", "32", "--qembedding", "4w", "--qembedding_group_size", "32",
           "--qlinear_encoder", "8da8w"]


def write_random_checkpoint(shape: str, out: Path) -> Path:
    """The shape with seeded random weights as a Hugging Face checkpoint (transformers' own class, bf16)."""
    from transformers import AutoModelForImageTextToText

    if (out / "model.safetensors.index.json").is_file() or (out / "model.safetensors").is_file():
        return out
    torch.manual_seed(0)
    config = SHAPES[shape]()
    config.dtype = "bfloat16"
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="2GB")
    del model
    gc.collect()
    return out


def program_size_mb(folder: Path) -> float | None:
    programs = sorted(folder.glob("*.pte"))
    return round(sum(p.stat().st_size for p in programs) / 1e6, 1) if programs else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--optimum-python", type=Path, required=True,
                        help="python of a venv with optimum-executorch 1.1 (docs/performance.md)")
    parser.add_argument("--max-seq-len", type=int, default=300)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", choices=["llm-exporters", "optimum-executorch"], default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    report["settings"] = {"shape": args.shape, "max_seq_len": args.max_seq_len, "ours": OURS, "optimum": OPTIMUM}

    if args.only in (None, "llm-exporters"):
        shape = write_shape(args.shape, args.out / "shape")
        run = args.out / "ours"
        cmd = exporter_command(["model=hf", f"model.checkpoint={shape}", "model.random_init=true", *OURS,
                                f"export.max_seq_len={args.max_seq_len}"], run)
        wall, peak, failed = run_measured_or_failed(cmd, args.out / "ours.log")
        ours = {"wall_s": round(wall, 1), "peak_rss_mb": round(peak), "failed": failed,
                "program_mb": program_size_mb(run)}
        if failed is None:
            runtime = subprocess.run([sys.executable, "-m", "benchmarks.vision", str(run)], check=True,
                                     capture_output=True, text=True)
            ours["runtime"] = json.loads(runtime.stdout.strip().splitlines()[-1])
        report["llm-exporters"] = ours
        print("llm-exporters", json.dumps(ours), flush=True)
        report_path.write_text(json.dumps(report, indent=2) + "\n")

    if args.only in (None, "optimum-executorch"):
        checkpoint = write_random_checkpoint(args.shape, args.out / "checkpoint")
        run = args.out / "optimum"
        cmd = [str(args.optimum_python.parent / "optimum-cli"), "export", "executorch", "--model", str(checkpoint),
               "--task", "image-text-to-text", "--recipe", "xnnpack", "--use_custom_sdpa", "--use_custom_kv_cache",
               *OPTIMUM, "--max_seq_len", str(args.max_seq_len), "--output_dir", str(run)]
        wall, peak, failed = run_measured_or_failed(cmd, args.out / "optimum.log")
        theirs = {"wall_s": round(wall, 1), "peak_rss_mb": round(peak), "failed": failed,
                  "program_mb": program_size_mb(run)}
        report["optimum-executorch"] = theirs
        print("optimum-executorch", json.dumps(theirs), flush=True)
        report_path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
