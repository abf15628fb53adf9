"""Where an export's peak RSS comes from: each stage's peak, and each step of emit (to_executorch's passes,
ExecuTorch's emitter and serializer, our writing, hashing and storage breakdown).

    python scripts/profile_memory.py                 # 134M Llama preset, xnnpack 8da4w, max_seq_len 256
    python scripts/profile_memory.py --layers 4      # the same shape cut to 4 layers (about 2 minutes)
    python scripts/profile_memory.py --layers 4 --backend portable quant.group_size=64   # + Hydra overrides

Runs the export's stages in this process (validate=false) and prints, per stage, the peak RSS (VmHWM,
reset before each stage), RSS at its end and after freed heap went back to the OS. Around each emit step
it prints RSS before, after and the step's own peak. This profile found that the manifest's storage
breakdown, not ExecuTorch's serialization, made emit the peak of the whole export (docs/DESIGN.md, 2c).
The steps are timed by wrapping ExecuTorch's functions in this process only; the exporter is not changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_export import PRESETS, hf_checkpoint  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from exporters.runtime.memory import current_rss_mb, peak_rss_mb, reset_peak_rss  # noqa: E402
from exporters.config import CONF_DIR, to_typed  # noqa: E402
from exporters.export import build_stages  # noqa: E402
from exporters.stages.pipeline import return_freed_memory  # noqa: E402


STEP_PEAKS: list[float] = []  # the probed steps' peaks within the current stage


def probed(owner: Any, name: str) -> None:
    """Replace ``owner.name`` with a wrapper that prints RSS before, after and the call's own peak."""
    inner: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = current_rss_mb()
        reset_peak_rss()
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        STEP_PEAKS.append(peak_rss_mb())
        print(f"    {name:36s} {time.perf_counter() - start:6.1f} s  RSS {before:6.0f} -> {current_rss_mb():6.0f} MB"
              f"  peak {STEP_PEAKS[-1]:6.0f} MB", flush=True)
        return result

    setattr(owner, name, wrapper)


def probe_emit() -> None:
    import executorch.exir._serialize._serialize as serialize
    import executorch.exir.program._program as program

    import exporters.stages.emit as emit

    for name in ("quant_fusion_and_const_prop_pass", "reinplace_pass", "emit_program", "serialize_for_executorch"):
        probed(program, name)
    probed(serialize, "serialize_pte_binary")
    for name in ("write_atomically", "sha256_of", "storage_breakdown"):
        probed(emit, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="134m")
    ap.add_argument("--layers", type=int, default=None, help="cut a random-weight preset to this many layers")
    ap.add_argument("--quant", default="8da4w")
    ap.add_argument("--backend", default="xnnpack")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides (export.max_seq_len=..., quant.group_size=...)")
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    if args.layers is not None:
        if preset.real:
            raise SystemExit(f"--layers cuts random-weight presets only; {args.preset} is a real checkpoint.")
        preset = dataclasses.replace(preset, layers=args.layers)
    out = Path(tempfile.mkdtemp(prefix="profile_memory_"))
    source = [f"model.checkpoint={hf_checkpoint(preset, out)}"] + ([] if preset.real else ["model.random_init=true"])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=llama", *source, f"quant={args.quant}", f"backend={args.backend}",
            "export.max_seq_len=256", "validate=false", "bench=false", *args.overrides])

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    probe_emit()
    print(f"{args.preset} ({preset.layers} layers), {args.backend} {args.quant}; RSS in MB; program in {out}")
    artifact: Any = None
    for stage in build_stages(to_typed(cfg), out):
        reset_peak_rss()
        STEP_PEAKS.clear()
        start = time.perf_counter()
        artifact = stage.run(artifact)
        at_end = current_rss_mb()
        peak = max([peak_rss_mb(), *STEP_PEAKS])  # a probed step resets the window: keep the steps' peaks too
        return_freed_memory()
        print(f"{stage.name:10s} {time.perf_counter() - start:7.1f} s  peak {peak:6.0f}  at end {at_end:6.0f}"
              f"  after returning freed heap {current_rss_mb():6.0f}", flush=True)


if __name__ == "__main__":
    main()
