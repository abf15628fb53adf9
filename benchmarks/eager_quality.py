"""Perplexity of the eager model, unquantized and quantized, on the validation text: no export, seconds.

    python -m benchmarks.eager_quality                                  # SmolLM2-135M, 8da4w g32: hqq, affine and gptq
    python -m benchmarks.eager_quality --quant 8da8w quant.group_size=0 # any conf/quant option, plus Hydra overrides
    python -m benchmarks.eager_quality --checkpoint <dir|.gguf> --algorithm gptq
    python -m benchmarks.eager_quality --preset tiny                    # quick check of the tool itself
    python -m benchmarks.eager_quality --quant pt2e_xnnpack_dynamic --algorithm hqq   # a PT2E quantizer's graphs

A quick way to compare quantization choices before paying for an export; the exported program tracks
the eager model it came from (validation checks that), so these numbers predict the program's. It runs the
export's own stages up to ``quantize`` (``exporters.export.run_stages``): the unquantized perplexity is the
``baseline`` stage's, and the quantized eager model is scored on the same windows with the same functions
(``exporters.runtime.quality``), once per ``--algorithm`` choice. With a PT2E quantizer (``quant=pt2e_*``) the
quantized model exists only as graphs: it runs up to ``capture`` and scores the graphs validation compares the
program with, driven as validation drives them (prompt, then one token per step).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any, Sequence

from benchmarks.exporting import compose_config
from benchmarks.presets import add_preset_arguments, preset_of, preset_overrides
from exporters.components.decoder import DECODER
from exporters.runtime.quality import full_sequence, perplexity, window_logits
from exporters.validation.methods import against


def eager_perplexities(cfg: Any, work_dir: Path) -> tuple[Any, float, Any, Any]:
    """Run ``cfg``'s export up to its quantize stage: the baseline (unquantized) quality, the quantized
    eager model's perplexity on the same windows, what the quantize stage did (the manifest's record), and the
    quantized model's predictions against the unquantized model's on every scored position (KL and top-1: less
    noisy than a perplexity decided by a few hard tokens; None for a PT2E quantizer's graphs)."""
    from exporters.console import native_stderr_to
    from exporters.export import run_stages

    work_dir.mkdir(parents=True, exist_ok=True)
    with native_stderr_to(work_dir / "native.log"):  # the LLM kernels' C++ chatter, kept off the console
        pt2e = cfg.quant.get("pt2e") is not None
        quantized, ctx = run_stages(cfg, work_dir, stop_after="capture" if pt2e else "quantize")
        baseline = ctx.baseline
        if baseline is None:
            raise SystemExit("the export ran no baseline stage: leave validate=true.")
        if pt2e:
            from exporters.runtime.driver import MethodRoles
            from exporters.runtime.programs import CapturedPrograms
            from exporters.stages.validate import driven

            graphs = CapturedPrograms(quantized.undelegated, quantized.model.state_buffers())
            roles = MethodRoles.choose({n: spec.shape for n, spec in quantized.methods.specs.items()})
            nll, agreement = baseline.text.nll(driven(graphs, roles, baseline.text, "eager")), None
        else:
            logits = window_logits(full_sequence(quantized.model), baseline.text)
            nll = baseline.text.nll(logits)
            unquantized = ctx.record(DECODER).unquantized
            agreement = against(unquantized, logits) if unquantized is not None else None
    return baseline, perplexity(nll, baseline.text.scored_tokens), ctx.quantization, agreement


def compare(args: argparse.Namespace, work: Path) -> None:
    """Print the unquantized perplexity, then the quantized eager model's for each ``--algorithm`` choice."""
    model: Sequence[str] = (["model=hf", f"model.checkpoint={args.checkpoint}"] if args.checkpoint
                            else preset_overrides(preset_of(args), work))
    common = [*model, f"quant={args.quant}", f"export.max_seq_len={args.max_seq_len}", "validate=true", "bench=false",
              *([f"validation.text_file={args.text_file}"] if args.text_file else [])]
    printed = False
    for algorithm in args.algorithm.split(","):
        cfg = compose_config([*common, f"quant.algorithm={algorithm}", *args.overrides])
        baseline, ppl, applied, agreement = eager_perplexities(cfg, work / algorithm)
        if not printed:
            print(f"{'unquantized (' + baseline.dtype + ')':28s} perplexity {baseline.perplexity:.2f} "
                  f"({baseline.text.scored_tokens} tokens of {baseline.text.source})", flush=True)
            printed = True
        q = cfg.quant
        cost = (f", KL to unquantized {float(agreement.kl.mean()):.4f}, top-1 {float(agreement.top1.double().mean()):.1%}"
                if agreement is not None else "")
        print(f"{f'{q.name} g{q.group_size} {algorithm}':28s} perplexity {ppl:.2f} "
              f"({ppl / baseline.perplexity - 1:+.1%}){cost}  [{applied.describe()}]", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset_arguments(ap, default="smollm2")
    ap.add_argument("--checkpoint", help="a Hugging Face folder or .gguf instead of --preset (model=hf)")
    ap.add_argument("--quant", default="8da4w", help="a conf/quant option (default 8da4w)")
    ap.add_argument("--algorithm", default="hqq,affine,gptq",
                    help="comma-separated quant.algorithm choices to compare")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--text-file", help="validation text (default: the shipped English paragraphs)")
    ap.add_argument("overrides", nargs="*",
                    help="more Hydra overrides (quant.group_size=64, validation.max_tokens=...)")
    args = ap.parse_intermixed_args()  # Hydra overrides may come before or after the options

    with tempfile.TemporaryDirectory(prefix="eager_quality_") as tmp:
        compare(args, Path(tmp))


if __name__ == "__main__":
    main()
