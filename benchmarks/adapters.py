"""What LoRA adapters cost in one program: size, export time, memory after load and decode speed per adapter.

    python -m benchmarks.adapters --preset smollm2 --quant 8da4w --counts 0,1,2,4 --out bench/adapters
    python -m benchmarks.adapters --preset smollm2 --layers 2 --counts 0,2     # quick check of the tool itself

Trains up to max(--counts) real LoRA adapters with PEFT on the preset's real checkpoint (tests/peft_adapters.py:
different texts, targets and ranks), then exports the base with the first N of them for each N of --counts, each
export alone in a child process (wall time, peak RSS), with validation on (each adapter validated against the
eager model with it applied). For each program: its size against N + 1 separate programs (a merged adapter has
the base's shapes, so each separate program is the size of the N = 0 one), the RSS a fresh process gains by
loading the base's prompt and step methods, then one adapter's and two adapters' as well (XNNPACK's weight cache
on, as our tools and phone builds load), and the prefill and decode speed of the base and of every adapter,
interleaved round by round. Writes report.json and report.md into --out. Needs the real checkpoint: the presets
with real weights (smollm2).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.exporting import exporter_command
from benchmarks.presets import add_preset_arguments, checkpoint_dir, exporter_overrides, preset_of
from exporters.manifest import Manifest
from exporters.runtime.driver import Driver
from exporters.runtime.memory import memory_after_load_mb, wait_with_peak_rss
from exporters.runtime.programs import LoadedProgram
from exporters.runtime.speed import measure_speeds
from tests.peft_adapters import RECIPES, train_adapter

REPO = Path(__file__).resolve().parent.parent


def export_with(overrides: list[str], adapters: dict[str, Path], run_dir: Path) -> dict:
    """One export in a child process with these adapters; its wall time, peak RSS and manifest."""
    extra = ["+model.adapters={" + ", ".join(f"{n}: {p}" for n, p in adapters.items()) + "}"] if adapters else []
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(run_dir / "export.log", "w") as log:
        child = subprocess.Popen(exporter_command([*overrides, *extra], run_dir), stdout=log, stderr=subprocess.STDOUT,
                                 cwd=REPO)
        peak = wait_with_peak_rss(child)
    wall = time.perf_counter() - start
    if child.returncode != 0:
        raise SystemExit(f"export with {list(adapters)} failed: see {run_dir / 'export.log'}")
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(peak), "manifest": Manifest.read(run_dir)}


def measure(run_dir: Path, manifest: Manifest, vocab: int, prompt: int, steps: int, repeats: int) -> dict:
    pte = run_dir / manifest.program.file
    base = [manifest.layout.prompt_method, manifest.layout.token_method]
    names = list(manifest.adapters)
    methods = {name: [a.methods[m] for m in base] for name, a in manifest.adapters.items()}
    rss = {"base": memory_after_load_mb(pte, base)[0]}
    if names:
        rss["base + 1 adapter"] = memory_after_load_mb(pte, base + methods[names[0]])[0]
    if len(names) > 1:
        rss["base + 2 adapters"] = memory_after_load_mb(pte, base + methods[names[0]] + methods[names[1]])[0]
    program = LoadedProgram(pte)
    drivers = {label: Driver.of(program, adapter) for label, adapter in [("base", None), *[(n, n) for n in names]]}
    speeds = measure_speeds(drivers, prompt, steps, repeats, vocab)
    return {"rss_after_load_mb": rss,
            "speed": {label: {"prefill_tok_s": s.prefill_tokens_per_s, "decode_tok_s": s.decode_tokens_per_s}
                      for label, s in speeds.items()}}


def report_md(rows: list[dict], preset: str, quant: str) -> str:
    base_size = rows[0]["size_mb"] if rows[0]["adapters"] == [] else None
    lines = [f"# LoRA adapters in one program: {preset}, {quant}", "",
             "| adapters | `.pte` MB | N + 1 separate programs MB | export s | peak RSS MB | RSS after load MB "
             "(base / +1 / +2) | decode tok/s (base; each adapter) | validation (KL, top-1, perplexity) |",
             "|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        n = len(r["adapters"])
        separate = f"{base_size * (n + 1):.1f}" if base_size else "-"
        rss = " / ".join(f"{v:.0f}" for v in r["rss_after_load_mb"].values())
        speed = "; ".join(f"{label} {s['decode_tok_s']:.1f}" for label, s in r["speed"].items())
        quality = "; ".join(f"{label} {v['kl_mean']:.2g}, {v['top1']:.1%}, {v['perplexity']:.2f}"
                            for label, v in r["validation"].items())
        lines.append(f"| {n} | {r['size_mb']:.1f} | {separate} | {r['wall_s']:.0f} | {r['peak_rss_mb']} | {rss} | "
                     f"{speed} | {quality} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_preset_arguments(parser, default="smollm2")
    parser.add_argument("--quant", default="8da4w")
    parser.add_argument("--counts", default="0,1,2,4", help="adapter counts to export, comma-separated")
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    preset = preset_of(args)
    if not preset.real:
        raise SystemExit(f"--preset {args.preset} has random weights: adapters are trained on real text, use smollm2.")
    counts = sorted({int(c) for c in args.counts.split(",")})
    if max(counts) > len(RECIPES):
        raise SystemExit(f"--counts: at most {len(RECIPES)} adapters (tests/peft_adapters.py RECIPES).")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_adapters_"))
    checkpoint = checkpoint_dir(preset, out)
    names = list(RECIPES)[:max(counts)]
    adapters = {n: train_adapter(checkpoint, out / "adapters" / n, RECIPES[n]) for n in names}
    overrides = [*exporter_overrides(preset, checkpoint), f"quant={args.quant}",
                 f"export.max_seq_len={args.max_seq_len}", "bench=false"]
    rows = []
    for n in counts:
        chosen = {k: adapters[k] for k in names[:n]}
        run_dir = out / f"adapters_{n}"
        done = export_with(overrides, chosen, run_dir)
        m: Manifest = done["manifest"]
        reports = {"base": m.validation, **{k: a.validation for k, a in m.adapters.items()}}
        rows.append({
            "adapters": list(chosen), "size_mb": round(m.program.size_bytes / 1e6, 2), "wall_s": done["wall_s"],
            "peak_rss_mb": done["peak_rss_mb"],
            "validation": {k: {"kl_mean": v.kl_mean, "top1": v.top1_agreement, "perplexity": v.perplexity,
                               "passed": v.passed} for k, v in reports.items() if v is not None},
            **measure(run_dir, m, preset.vocab, args.prompt_len, args.steps, args.repeats),
        })
        print(json.dumps(rows[-1]), flush=True)
    (out / "report.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "report.md").write_text(report_md(rows, args.preset + (f" ({args.layers} layers)" if args.layers else ""),
                                             args.quant))
    print((out / "report.md").read_text())


if __name__ == "__main__":
    main()
