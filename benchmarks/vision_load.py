"""Peak memory of reading a vision-language checkpoint's vision encoder: ours against transformers' whole-model load.

    python -m benchmarks.vision_load gemma3-4b --out /tmp/gemma3-4b-weights     # writes 8.6 GB of bf16 once
    python -m benchmarks.vision_load smolvlm-256m --out /tmp/smolvlm-256m-weights

Writes seeded random weights of a published shape (``benchmarks.vision_shapes``) in bf16 as transformers saves them,
then, each in a fresh process, reads the vision encoder two ways and takes the kernel's peak RSS over the process's
baseline: ``models.vision_encoder.load_vision_encoder`` (the tower and projector built alone, only their tensors
read) and transformers' ``from_pretrained`` of the whole model in fp32 (how the encoder was read before, and what a
script that takes ``model.vision_tower`` from transformers pays). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.vision_shapes import SHAPES

WAYS = ("ours", "transformers")


def write_weights(shape: str, out: Path) -> Path:
    """The shape's random bf16 weights in ``out`` (kept: written once)."""
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    import transformers

    from models.checkpoint import default_dtype

    config = SHAPES[shape]()
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16):  # made in bf16: Gemma 3 4B in fp32 would not fit beside its copy
        model = getattr(transformers, config.architectures[0])(config)
    with torch.no_grad():  # Gemma 3's projector starts at zero: every image would embed to nothing
        for p in (p for name, p in model.named_parameters() if "multi_modal_projector" in name and not p.any()):
            p.normal_(0.0, 0.02)
    model.save_pretrained(out, max_shard_size="2GB")
    return out


def measure(way: str, folder: Path) -> dict[str, float]:
    """In this (fresh) process: peak RSS over the baseline while reading the encoder ``way``."""
    import torch

    from exporters.runtime.memory import current_rss_mb, peak_rss_mb, reset_peak_rss
    from models.checkpoint import open_checkpoint
    from models.vision_encoder import load_vision_encoder, vision_parameters

    config = open_checkpoint(folder, need_weights=False).hf_config
    before = current_rss_mb()
    reset_peak_rss()
    if way == "ours":
        load_vision_encoder(str(folder), config)
    else:
        import transformers

        getattr(transformers, config.architectures[0]).from_pretrained(folder, dtype=torch.float32)
    return {"way": way, "baseline_mb": round(before), "peak_over_baseline_mb": round(peak_rss_mb() - before),
            "encoder_params_m": round(vision_parameters(config) / 1e6, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, required=True, help="where the random checkpoint is written (kept)")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # the child process's one measurement
    args = parser.parse_args()
    if args.way:
        print(json.dumps(measure(args.way, args.out)))
        return
    folder = write_weights(args.shape, args.out)
    size_mb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6
    rows = []
    for way in WAYS:
        done = subprocess.run([sys.executable, "-m", "benchmarks.vision_load", args.shape, "--out", str(folder),
                               "--way", way], capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else
                    {"way": way, "failed": done.stderr.strip().splitlines()[-1:]})
    print(json.dumps({"shape": args.shape, "checkpoint_mb": round(size_mb), "reads": rows}))


if __name__ == "__main__":
    main()
