"""Peak memory of loading a checkpoint, as a multiple of its size on disk.

    python -m benchmarks.load_memory                         # the 271m preset in bf16 (542 MB), 3 shards
    python -m benchmarks.load_memory --dtype fp32 --shards 1 --size-mb 540   # as many layers as make ~540 MB
    python -m benchmarks.load_memory --preset tiny           # quick check of the tool itself

Writes seeded random weights of the preset's shape (benchmarks/presets.py; ``--size-mb`` rescales its layer
count instead), sharded like a Hub checkpoint, then loads it with the exporter's loader (``open_checkpoint`` +
``build_model``) in a fresh process and reads the kernel's peak-RSS counter twice: right after loading (the
weights are copy-on-write views of the memory-mapped files, so pages not yet read do not count), and after
every page of every weight has been read once (what an export then touches).

Prints one JSON line: checkpoint bytes S, RSS before loading (after a warm-up load of a tiny
checkpoint), peak RSS while loading and with every weight resident, and
``(peak - before_loading) / S`` for both (the target is <= 1.3).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.presets import add_preset_arguments, preset_of, write_random_checkpoint

REPO = Path(__file__).resolve().parent.parent
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def measure_loading(checkpoint: Path) -> dict[str, float]:
    """Load ``checkpoint`` in this (fresh) process: RSS before, peak while loading, peak with every weight read."""
    from exporters.runtime.memory import current_rss_mb, peak_rss_mb, reset_peak_rss
    from models.checkpoint import build_model, open_checkpoint
    from models.tiny import write_tiny_checkpoint

    # Warm-up: load a tiny checkpoint first, so every lazy import happens before the baseline.
    with tempfile.TemporaryDirectory() as tmp:
        build_model(open_checkpoint(write_tiny_checkpoint(tmp, train_steps=0)), 16)
    mb = 1024 * 1024
    reset_peak_rss()  # the peak-RSS counter starts again at the current RSS
    base = current_rss_mb() * mb
    start = time.perf_counter()
    model = build_model(open_checkpoint(checkpoint), 256)
    seconds = time.perf_counter() - start
    peak = peak_rss_mb() * mb
    for p in model.parameters():  # read one element per 2 KB: every page of every weight becomes resident
        p.detach().reshape(-1)[::512].float().sum()
    resident = peak_rss_mb() * mb
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"rss_before_loading": base, "peak_rss_loading": peak, "peak_rss_weights_resident": resident,
            "model_param_bytes": params, "load_seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset_arguments(parser, default="271m")
    parser.add_argument("--dtype", default="bf16", choices=list(ITEMSIZE))
    parser.add_argument("--size-mb", type=int, default=None,
                        help="instead of the preset's layer count, as many layers as make about this many MB")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="checkpoint directory (default: a temp dir)")
    parser.add_argument("--measure-loading", type=Path, default=None, help=argparse.SUPPRESS)  # the fresh process
    args = parser.parse_args()
    if args.measure_loading:
        print(json.dumps(measure_loading(args.measure_loading)))
        return

    preset = preset_of(args)
    if args.size_mb is not None:
        preset = preset.scaled_to(args.size_mb * 1e6, ITEMSIZE[args.dtype])
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.out or Path(tmp) / "ckpt"
        size = write_random_checkpoint(preset, ckpt, args.dtype, args.shards)
        child = subprocess.run([sys.executable, "-m", "benchmarks.load_memory", "--measure-loading", str(ckpt)],
                               capture_output=True, text=True, cwd=REPO)
        if child.returncode != 0:
            raise SystemExit(f"loading {ckpt} failed:\n{child.stderr[-3000:]}")
        result = json.loads(child.stdout.strip().splitlines()[-1])
    base = result["rss_before_loading"]
    print(json.dumps({
        "preset": args.preset, "layers": preset.layers, "dtype": args.dtype, "shards": args.shards,
        "checkpoint_bytes": size, **result,
        "loading_rss_over_checkpoint": round((result["peak_rss_loading"] - base) / size, 3),
        "resident_rss_over_checkpoint": round((result["peak_rss_weights_resident"] - base) / size, 3),
    }))


if __name__ == "__main__":
    main()
