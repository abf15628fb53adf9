"""Where an export's peak RSS comes from: each stage's peak, and each step of emit (to_executorch's passes,
ExecuTorch's emitter and serializer, our writing, hashing and storage breakdown).

    python -m benchmarks.profile_memory                 # 134M Llama preset, xnnpack 8da4w, max_seq_len 256
    python -m benchmarks.profile_memory --layers 4      # the same shape cut to 4 layers (about 2 minutes)
    python -m benchmarks.profile_memory --layers 4 --backend portable quant.group_size=64   # + Hydra overrides
    python -m benchmarks.profile_memory --preset 1b --quant 8da4w_emb4w

Runs the export's stages in this process (``exporters.export.run_stages``, validate=false unless ``--validate``) with an observer
that resets the kernel's peak-RSS counter (VmHWM) when each stage starts and prints, when it finishes, the
stage's peak and the RSS left after the freed heap went back to the OS. Around each emit step it prints RSS
before, after and the step's own peak. This profile found that the manifest's storage breakdown, not ExecuTorch's serialization, made emit the peak of the
whole export (docs/DESIGN.md, 2c). The steps are timed by wrapping ExecuTorch's functions in this process
only; the exporter is not changed.
"""

from __future__ import annotations

import argparse
import functools
import logging
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from benchmarks.exporting import preset_config
from benchmarks.presets import add_preset_arguments, preset_of
from exporters.runtime.memory import current_rss_mb, peak_rss_mb, reset_peak_rss


class MemoryObserver:
    """Resets the peak-RSS counter as each stage starts; prints the stage's peak and RSS as it finishes."""

    def __init__(self) -> None:
        self.step_peaks: list[float] = []  # the probed steps' peaks within the current stage

    def stage_started(self, name: str) -> None:
        reset_peak_rss()
        self.step_peaks.clear()

    def stage_finished(self, name: str, seconds: float) -> None:
        peak = max([peak_rss_mb(), *self.step_peaks])  # a probed step resets the window: keep the steps' peaks too
        # The pipeline has handed the stage's freed heap back to the OS (return_freed_memory) by now.
        print(f"{name:10s} {seconds:7.1f} s  peak {peak:6.0f}  after returning freed heap {current_rss_mb():6.0f}",
              flush=True)

    def probe(self, owner: Any, name: str) -> None:
        """Replace ``owner.name`` with a wrapper that prints RSS before, after and the call's own peak."""
        inner: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(inner)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before = current_rss_mb()
            reset_peak_rss()
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            self.step_peaks.append(peak_rss_mb())
            print(f"    {name:36s} {time.perf_counter() - start:6.1f} s  RSS {before:6.0f} -> "
                  f"{current_rss_mb():6.0f} MB  peak {self.step_peaks[-1]:6.0f} MB", flush=True)
            return result

        setattr(owner, name, wrapper)


# The steps of lowering and emit probed: (module or module:Class, function names). A name that no longer exists is
# skipped with a note.
PROBED_STEPS = (
    # lowering: to_edge's decompositions (twice per method), then partitioning and each partition's preprocess
    ("torch.export.exported_program:ExportedProgram", ("run_decompositions",)),
    ("executorch.exir.program._program", ("_gen_edge_manager_for_partitioners",)),
    ("executorch.exir.backend.backend_api", ("get_fake_program", "update_to_real_program",
                                             "_maybe_duplicate_constant_nodes", "_create_partitions",
                                             "lower_all_submodules_to_backend")),
    ("executorch.backends.xnnpack.xnnpack_preprocess:XnnpackBackend", ("preprocess",)),
    ("executorch.exir.program._program",
     ("quant_fusion_and_const_prop_pass", "reinplace_pass", "emit_program", "serialize_for_executorch")),
    # serialize_for_executorch here: emit's second serialization when a method is an alias (exporters.program.internals).
    ("executorch.exir._serialize._serialize", ("serialize_pte_binary", "serialize_for_executorch")),
    ("exporters.stages.emit", ("write_atomically", "sha256_of", "storage_breakdown")),
    # validation: loading the program, then each side's predictions
    ("exporters.runtime.programs:LoadedProgram", ("__init__",)),
    ("exporters.stages.validate", ("window_logits", "driven")),
    # advise: per remedy, a fresh model built (the plan's ModelBuild, as load builds it), quantized (GPTQ's
    # calibrated pass within it) and scored
    ("exporters.plan.component:ModelBuild", ("build",)),
    ("exporters.stages.advise", ("window_logits",)),
    ("exporters.quant.advice", ("quantize_model",)),
    ("exporters.quant.apply", ("quantize_calibrated",)),
)


def probe_steps(observer: MemoryObserver) -> None:
    import importlib

    for where, names in PROBED_STEPS:
        module_name, _, class_name = where.partition(":")
        owner = importlib.import_module(module_name)
        owner = getattr(owner, class_name) if class_name else owner
        for name in names:
            if hasattr(owner, name):
                observer.probe(owner, name)
            else:
                print(f"(not probed: {where}.{name} does not exist)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset_arguments(ap, default="134m")
    ap.add_argument("--quant", default="8da4w")
    ap.add_argument("--backend", default="xnnpack")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--stop-after", default=None, help="the last stage to run (default: all of them)")
    ap.add_argument("--validate", action="store_true", help="validate too (the default of the exporter's CLI)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides (export.max_seq_len=..., quant.group_size=...)")
    args = ap.parse_args()
    from exporters.export import run_stages

    preset = preset_of(args)
    out = Path(tempfile.mkdtemp(prefix="profile_memory_"))
    cfg = preset_config(preset, out, [f"quant={args.quant}", f"backend={args.backend}",
                                      f"export.max_seq_len={args.max_seq_len}",
                                      f"validate={str(args.validate).lower()}", "bench=false",
                                      *args.overrides])
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    observer = MemoryObserver()
    probe_steps(observer)
    print(f"{args.preset} ({preset.layers} layers), {args.backend} {args.quant}; RSS in MB; program in {out}")
    run_stages(cfg, out, stop_after=args.stop_after, observer=observer)


if __name__ == "__main__":
    main()
