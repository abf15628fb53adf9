"""Lowering with and without one of its shortcuts, in one process, same bytes.

    python -m benchmarks.lowering_time --preset smollm2                          # torchao's quant ops shape-only
    python -m benchmarks.lowering_time --preset smollm2 --shortcut copy-pass     # the copy pass where it removes one
    python -m benchmarks.lowering_time --preset 1b --quant 8da4w_emb4w

``--shortcut shape-only``: torchao's quantize/dequantize/choose-qparams ops have no fake kernel, so every pass of
lowering re-runs their Python bodies on fake tensors; ``exporters.program.internals.torchao_quant_ops_shape_only``
gives them their shapes directly. ``--shortcut copy-pass``: XNNPACK's RemoveRedundantCopyPass runs only on the
partitions where it would remove a copy (``internals._redundant_copies``), against every partition. This exports
the preset up to lowering twice per round, alternating (off, on, off, on for ``--rounds 2``), times the lower stage
and checks that both write the same program bytes (sha256 of ``to_executorch``'s output). Measure alone.
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
from typing import Iterator

from benchmarks.exporting import preset_config
from benchmarks.presets import add_preset_arguments, preset_of


@contextlib.contextmanager
def shortcut_off(name: str) -> Iterator[None]:
    """Within this block, lowering does without the shortcut ``name`` (a key of SHORTCUTS)."""
    from exporters.program import internals
    from exporters.stages import lower

    if name == "shape-only":
        kept = lower.torchao_quant_ops_shape_only
        lower.torchao_quant_ops_shape_only = contextlib.nullcontext  # type: ignore[assignment]
        try:
            yield
        finally:
            lower.torchao_quant_ops_shape_only = kept
    else:
        conditions = internals._XNNPACK_PASS_CONDITIONS
        kept = conditions["RemoveRedundantCopyPass"]
        conditions["RemoveRedundantCopyPass"] = lambda graph: True
        try:
            yield
        finally:
            conditions["RemoveRedundantCopyPass"] = kept


SHORTCUTS = ("shape-only", "copy-pass")


def lower_once(cfg, out: Path, shortcut: str, on: bool) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    """Seconds of the lower stage, and the sha256 of the emitted program."""
    from exporters.export import run_stages
    from exporters.stages.emit import to_executorch

    with contextlib.nullcontext() if on else shortcut_off(shortcut):
        lowered, ctx = run_stages(cfg, out, stop_after="lower")
    seconds = ctx.timings["lower"]
    digest = hashlib.sha256(to_executorch(lowered.edge, lowered.methods.aliases).buffer).hexdigest()
    return seconds, digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset_arguments(ap, default="smollm2")
    ap.add_argument("--quant", default="8da4w")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--shortcut", choices=SHORTCUTS, default="shape-only")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    p = preset_of(args)
    root = Path(tempfile.mkdtemp(prefix="lowering_time_"))
    cfg = preset_config(p, root, [f"quant={args.quant}", f"export.max_seq_len={args.max_seq_len}", "validate=false",
                                  "bench=false"])
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    digests = set()
    started = time.perf_counter()
    for r in range(args.rounds):
        for mode in ("off", "on"):
            s, digest = lower_once(cfg, root / f"{mode}{r}", args.shortcut, on=mode == "on")
            seconds[mode].append(round(s, 1))
            digests.add(digest)
            print(f"round {r + 1}: lower {s:.1f} s with {args.shortcut} {mode}, program {digest[:12]}", flush=True)
    before, after = statistics.median(seconds["off"]), statistics.median(seconds["on"])
    result = {"preset": args.preset, "quant": args.quant, "shortcut": args.shortcut, "lower_s": seconds,
              "ratio": round(after / before, 2), "same_bytes": len(digests) == 1,
              "wall_s": round(time.perf_counter() - started, 1)}
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
