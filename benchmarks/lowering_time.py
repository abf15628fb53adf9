"""Lowering with and without torchao's quant ops computed shape-only on fake tensors, in one process, same bytes.

    python -m benchmarks.lowering_time --preset smollm2
    python -m benchmarks.lowering_time --preset 1b --quant 8da4w_emb4w

torchao's quantize/dequantize/choose-qparams ops have no fake kernel, so every pass of lowering re-runs their
Python bodies on fake tensors; ``exporters.program.internals.torchao_quant_ops_shape_only`` gives them their shapes
directly. This exports the preset up to lowering twice, alternating (without, with, without, with for
``--rounds 2``), times the lower stage and checks that both write the same program bytes (sha256 of
``to_executorch``'s output). Measure alone.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks.exporting import preset_config
from benchmarks.presets import add_preset_arguments, preset_of


def lower_once(cfg, out: Path, shape_only: bool) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    """Seconds of the lower stage, and the sha256 of the emitted program."""
    from exporters.export import run_stages
    from exporters.stages import lower
    from exporters.stages.emit import to_executorch

    kept = lower.torchao_quant_ops_shape_only
    if not shape_only:
        lower.torchao_quant_ops_shape_only = contextlib.nullcontext  # type: ignore[assignment]
    try:
        lowered, ctx = run_stages(cfg, out, stop_after="lower")
    finally:
        lower.torchao_quant_ops_shape_only = kept
    seconds = ctx.timings["lower"]
    digest = hashlib.sha256(to_executorch(lowered.edge, lowered.methods.aliases).buffer).hexdigest()
    return seconds, digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset_arguments(ap, default="smollm2")
    ap.add_argument("--quant", default="8da4w")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    p = preset_of(args)
    root = Path(tempfile.mkdtemp(prefix="lowering_time_"))
    cfg = preset_config(p, root, [f"quant={args.quant}", f"export.max_seq_len={args.max_seq_len}", "validate=false",
                                  "bench=false"])
    seconds: dict[str, list[float]] = {"bodies": [], "shape_only": []}
    digests = set()
    started = time.perf_counter()
    for r in range(args.rounds):
        for mode in ("bodies", "shape_only"):
            s, digest = lower_once(cfg, root / f"{mode}{r}", shape_only=mode == "shape_only")
            seconds[mode].append(round(s, 1))
            digests.add(digest)
            print(f"round {r + 1}: lower {s:.1f} s with torchao's {mode.replace('_', '-')} ops, program {digest[:12]}",
                  flush=True)
    before, after = statistics.median(seconds["bodies"]), statistics.median(seconds["shape_only"])
    result = {"preset": args.preset, "quant": args.quant, "lower_s": seconds, "ratio": round(after / before, 2),
              "same_bytes": len(digests) == 1, "wall_s": round(time.perf_counter() - started, 1)}
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
