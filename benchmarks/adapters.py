"""What LoRA adapters cost in one program: size, export time, memory after load and decode speed per adapter.

    python -m benchmarks.adapters --preset smollm2 --quant 8da4w --counts 0,1,2,4 --out bench/adapters
    python -m benchmarks.adapters --preset smollm2 --layers 2 --counts 0,2     # quick check of the tool itself
    python -m benchmarks.adapters --preset smollm2 --layers 2 --counts 0,2 --quant fp32 --export-llm

Trains up to max(--counts) real LoRA adapters with PEFT on the preset's real checkpoint (tests/peft_adapters.py:
different texts, targets and ranks), then exports the base with the first N of them for each N of --counts, each
export alone in a child process (wall time, peak RSS), with validation on (each adapter validated against the
eager model with it applied). For each program: its size against N + 1 separate programs (a merged adapter has
the base's shapes, so each separate program is the size of the N = 0 one), the RSS a fresh process gains by
loading the base's prompt and step methods, then one adapter's and two adapters' as well (XNNPACK's weight cache
on, as our tools and phone builds load), and the prefill and decode speed of the base and of every adapter,
interleaved round by round. Every program's logits on the validation text (teacher-forced) are compared with
PEFT's eager fp32 model with the same adapter (top-1 agreement, mean KL, max |diff|).

With --export-llm, the same base and adapters are exported and measured the same way with ExecuTorch's own
``export_llm`` (its multimethod LoRA export: one ``forward`` method for the base and one ``<adapter>_forward`` per
adapter, sharing the KV cache), as a second table; the two programs of each N are timed in the same rounds.
export_llm reads Meta's rotary layout and one rank and alpha / r for every module of an adapter, so each adapter
is handed to it converted (:func:`export_llm_adapter`); its LoRA matrices stay fp32 under every quant (its 8da4w
skips them). Writes report.json and report.md into --out. Needs the real checkpoint: the presets with real
weights (smollm2).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.export import EXPORT_LLM, EXPORT_LLM_QUANT, export_llm_overrides, unpermute
from benchmarks.exporting import compose_config, exporter_command
from benchmarks.presets import Preset, add_preset_arguments, checkpoint_dir, exporter_overrides, preset_of
from exporters.manifest import Manifest
from exporters.runtime.driver import Driver
from exporters.runtime.memory import memory_after_load_mb, wait_with_peak_rss
from exporters.runtime.programs import LoadedProgram
from exporters.runtime.quality import Agreement, read_text
from exporters.runtime.speed import measure_speeds
from tests.peft_adapters import RECIPES, train_adapter

REPO = Path(__file__).resolve().parent.parent
# The check against PEFT: this many tokens of the validation text, the first CHECK_PROMPT through the prompt
# method, every later one through the step method.
CHECK_TOKENS, CHECK_PROMPT = 96, 32
EXPORT_LLM_ADAPTERS = ("export_llm's adapters (export_llm/adapters): q/k B rows in Meta's rotary layout; each module's "
                       "PEFT scale folded into B and ranks zero-padded to the adapter's largest, r = lora_alpha = that "
                       "rank (export_llm applies one rank and alpha / r to every module: no use_rslora, rank_pattern "
                       "or alpha_pattern).")
# A program to measure: its .pte, the base's prompt and step methods, each adapter's.
Program = tuple[Path, list[str], dict[str, list[str]]]


def run_child(cmd: list[str], log: Path) -> dict:
    """Run an export in a child process; its wall time and peak RSS."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as fh:
        child = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
        peak = wait_with_peak_rss(child)
    wall = time.perf_counter() - start
    if child.returncode != 0:
        raise SystemExit(f"export failed: see {log}")
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(peak)}


def export_with(overrides: list[str], adapters: dict[str, Path], run_dir: Path) -> dict:
    """One export in a child process with these adapters; its wall time, peak RSS and manifest."""
    extra = ["+model.adapters={" + ", ".join(f"{n}: {p}" for n, p in adapters.items()) + "}"] if adapters else []
    done = run_child(exporter_command([*overrides, *extra], run_dir), run_dir / "export.log")
    return {**done, "manifest": Manifest.read(run_dir)}


def export_llm_adapter(folder: Path, preset: Preset, out: Path) -> Path:
    """A PEFT adapter as export_llm computes it exactly on the Meta checkpoint: B's q/k rows in Meta's rotary
    layout (as :func:`benchmarks.export.meta_checkpoint` has the base's), and, because export_llm applies one
    rank and alpha / r to every module (ignoring use_rslora, rank_pattern and alpha_pattern), each module's PEFT
    scale folded into B, its rank zero-padded to the largest, and r = lora_alpha = that rank. Same key names."""
    from peft import LoraConfig
    from peft.utils.other import get_pattern_key
    from safetensors.torch import load_file, save_file

    config = LoraConfig.from_pretrained(str(folder))
    weights = load_file(str(folder / "adapter_model.safetensors"))
    rank = max(w.shape[0] for key, w in weights.items() if ".lora_A." in key)
    converted = {}
    for key_a in [key for key in weights if ".lora_A." in key]:
        key_b = key_a.replace(".lora_A.", ".lora_B.")
        a, b = weights[key_a], weights[key_b]
        module = key_a.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
        r = a.shape[0]
        b = b * (alpha / (math.sqrt(r) if config.use_rslora else r))
        if module.endswith(("q_proj", "k_proj")):
            b = unpermute(b, preset.heads if module.endswith("q_proj") else preset.kv_heads)
        converted[key_a] = torch.nn.functional.pad(a, (0, 0, 0, rank - r)).contiguous()
        converted[key_b] = torch.nn.functional.pad(b, (0, rank - r)).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(converted, str(out / "adapter_model.safetensors"))
    as_peft = json.loads((folder / "adapter_config.json").read_text())
    as_peft.update(r=rank, lora_alpha=rank, use_rslora=False, rank_pattern={}, alpha_pattern={})
    (out / "adapter_config.json").write_text(json.dumps(as_peft, indent=2))
    return out


def export_llm_with(base_overrides: list[str], adapters: dict[str, Path], run_dir: Path) -> dict:
    """One export_llm multimethod export in a child process: ``forward`` (the base) and ``<adapter>_forward``
    per adapter, sharing the KV cache. A list of methods is no command-line override, so the whole config goes
    in a YAML file (``--config``)."""
    from omegaconf import OmegaConf

    config = OmegaConf.from_dotlist([*base_overrides, f"export.output_dir={run_dir}",
                                     f"export.output_name={run_dir / 'model.pte'}"])
    config.multimethod = {"share_mutable_buffers": True, "methods": [
        {"method_name": "forward", "lora_config": None},
        *({"method_name": f"{name}_forward", "lora_config": {
            "adapter_checkpoint": str(folder / "adapter_model.safetensors"),
            "adapter_config": str(folder / "adapter_config.json")}} for name, folder in adapters.items())]}
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(config, run_dir / "export_llm.yaml")
    return run_child([*EXPORT_LLM, "--config", str(run_dir / "export_llm.yaml")], run_dir / "export.log")


def check_text(checkpoint: Path) -> torch.Tensor:
    """The first :data:`CHECK_TOKENS` tokens of the validation text, [1, T]."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(checkpoint))(read_text(None)[0])["input_ids"][:CHECK_TOKENS]
    return torch.tensor([ids])


def peft_logits(checkpoint: Path, adapters: dict[str, Path], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """PEFT's eager fp32 logits [T, V] on ``tokens``, of the base and with each adapter: the reference every
    program is checked against (no exporter's own eager model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    logits = {}
    for label, folder in [("base", None), *adapters.items()]:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
        if folder is not None:
            model = PeftModel.from_pretrained(model, str(folder))
        with torch.no_grad():
            logits[label] = model(input_ids=tokens).logits[0]
    return logits


def against_peft(driver: Driver, tokens: torch.Tensor, reference: torch.Tensor) -> dict:
    """The program's teacher-forced predictions after the prompt against PEFT's at the same positions."""
    predictions = [driver.prefill(tokens[:, :CHECK_PROMPT])]
    for position in range(CHECK_PROMPT, tokens.shape[1] - 1):
        predictions.append(driver.decode_one_token(tokens[:, position:position + 1], position))
    a = Agreement.of(reference[CHECK_PROMPT - 1:-1], torch.cat(predictions))
    return {"top1": float(a.top1.double().mean()), "kl_mean": float(a.kl.mean()), "max_abs": a.max_abs_error}


def measure(programs: dict[str, Program], reference: dict[str, torch.Tensor], tokens: torch.Tensor, vocab: int,
            prompt: int, steps: int, repeats: int) -> dict[str, dict]:
    """For each exporter's program: the RSS a fresh process gains by loading the base's methods, then one and two
    adapters' as well; the check against PEFT; the prefill and decode speed of the base and of each adapter, rounds
    interleaved over all programs, so that the exporters are timed under the same conditions."""
    results, drivers = {}, {}
    for exporter, (pte, base, adapters) in programs.items():
        names = list(adapters)
        rss = {"base": memory_after_load_mb(pte, base)[0]}
        if names:
            rss["base + 1 adapter"] = memory_after_load_mb(pte, base + adapters[names[0]])[0]
        if len(names) > 1:
            rss["base + 2 adapters"] = memory_after_load_mb(pte, base + adapters[names[0]] + adapters[names[1]])[0]
        program = LoadedProgram(pte)
        mine = {label: Driver.of(program, adapter) for label, adapter in [("base", None), *[(n, n) for n in names]]}
        results[exporter] = {"rss_after_load_mb": rss, "speed": {},
                             "vs_peft": {label: against_peft(d, tokens, reference[label]) for label, d in mine.items()}}
        drivers.update({(exporter, label): d for label, d in mine.items()})
    speeds = measure_speeds({f"{e}: {label}": d for (e, label), d in drivers.items()}, prompt, steps, repeats, vocab)
    for (exporter, label), s in zip(drivers, speeds.values()):
        results[exporter]["speed"][label] = {"prefill_tok_s": s.prefill_tokens_per_s,
                                             "decode_tok_s": s.decode_tokens_per_s}
    return results


def table(rows: list[dict], title: str) -> list[str]:
    """One exporter's rows; its validation column only where the exporter validates (ours)."""
    base_size = rows[0]["size_mb"] if rows[0]["adapters"] == [] else None
    validated = "validation" in rows[0]
    lines = [title, "",
             "| adapters | `.pte` MB | N + 1 separate programs MB | export s | peak RSS MB | RSS after load MB "
             "(base / +1 / +2) | decode tok/s (base; each adapter) | vs PEFT fp32 (top-1, KL, max abs diff) |"
             + (" validation (KL, top-1, perplexity) |" if validated else ""),
             "|---:|---:|---:|---:|---:|---|---|---|" + ("---|" if validated else "")]
    for r in rows:
        n = len(r["adapters"])
        separate = f"{base_size * (n + 1):.1f}" if base_size else "-"
        rss = " / ".join(f"{v:.0f}" for v in r["rss_after_load_mb"].values())
        speed = "; ".join(f"{label} {s['decode_tok_s']:.1f}" for label, s in r["speed"].items())
        check = "; ".join(f"{label} {v['top1']:.1%}, {v['kl_mean']:.2g}, {v['max_abs']:.2g}"
                          for label, v in r["vs_peft"].items())
        quality = "; ".join(f"{label} {v['kl_mean']:.2g}, {v['top1']:.1%}, {v['perplexity']:.2f}"
                            for label, v in r.get("validation", {}).items())
        lines.append(f"| {n} | {r['size_mb']:.1f} | {separate} | {r['wall_s']:.0f} | {r['peak_rss_mb']} | {rss} | "
                     f"{speed} | {check} |" + (f" {quality} |" if validated else ""))
    return lines


def report_md(report: dict, preset: str, quant: str) -> str:
    lines = table(report["llm-exporters"], f"# LoRA adapters in one program: {preset}, {quant}")
    if "export_llm" in report:
        lines += ["", *table(report["export_llm"], f"## The same with ExecuTorch's export_llm (multimethod LoRA), "
                                                     f"{quant}"), "", EXPORT_LLM_ADAPTERS]
    return "\n".join(lines) + "\n"


def export_ours(overrides: list[str], adapters: dict[str, Path], run_dir: Path) -> tuple[dict, Program]:
    """Our export with these adapters: its row so far, and its program's methods."""
    done = export_with(overrides, adapters, run_dir)
    m: Manifest = done["manifest"]
    reports = {"base": m.validation, **{k: a.validation for k, a in m.adapters.items()}}
    base = [m.layout.prompt_method, m.layout.token_method]
    row = {"adapters": list(adapters), "size_mb": round(m.program.size_bytes / 1e6, 2), "wall_s": done["wall_s"],
           "peak_rss_mb": done["peak_rss_mb"],
           "validation": {k: {"kl_mean": v.kl_mean, "top1": v.top1_agreement, "perplexity": v.perplexity,
                              "passed": v.passed} for k, v in reports.items() if v is not None}}
    methods = {name: [a.methods[method] for method in base] for name, a in m.adapters.items()}
    return row, (run_dir / m.program.file, base, methods)


def export_theirs(base_overrides: list[str], adapters: dict[str, Path], run_dir: Path) -> tuple[dict, Program]:
    """export_llm's export with these (converted) adapters: its row so far, and its program's methods."""
    done = export_llm_with(base_overrides, adapters, run_dir)
    pte = run_dir / "model.pte"
    row = {"adapters": list(adapters), "size_mb": round(pte.stat().st_size / 1e6, 2), **done}
    return row, (pte, ["forward"], {name: [f"{name}_forward"] for name in adapters})


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
    parser.add_argument("--export-llm", action="store_true",
                        help="also export and measure the same with ExecuTorch's export_llm (multimethod LoRA)")
    args = parser.parse_args()
    preset = preset_of(args)
    if not preset.real:
        raise SystemExit(f"--preset {args.preset} has random weights: adapters are trained on real text, use smollm2.")
    counts = sorted({int(c) for c in args.counts.split(",")})
    if max(counts) > len(RECIPES):
        raise SystemExit(f"--counts: at most {len(RECIPES)} adapters (tests/peft_adapters.py RECIPES).")
    if args.export_llm and args.quant not in EXPORT_LLM_QUANT:
        raise SystemExit(f"--export-llm: export_llm has no spelling of --quant {args.quant}; use one of "
                         f"{', '.join(EXPORT_LLM_QUANT)} (benchmarks/export.py EXPORT_LLM_QUANT).")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_adapters_"))
    checkpoint = checkpoint_dir(preset, out)
    names = list(RECIPES)[:max(counts)]
    adapters = {n: train_adapter(checkpoint, out / "adapters" / n, RECIPES[n]) for n in names}
    overrides = [*exporter_overrides(preset, checkpoint), f"quant={args.quant}",
                 f"export.max_seq_len={args.max_seq_len}", "bench=false"]
    tokens = check_text(checkpoint)
    reference = peft_logits(checkpoint, adapters, tokens)
    rows: dict[str, list[dict]] = {"llm-exporters": []}
    if args.export_llm:
        root = out / "export_llm"
        root.mkdir(parents=True, exist_ok=True)
        group_size = compose_config(overrides).quant.group_size  # ours, so both quantize alike
        llm_overrides = export_llm_overrides(preset, argparse.Namespace(
            quant=args.quant, group_size=group_size, max_seq_len=args.max_seq_len), root, checkpoint)
        converted = {n: export_llm_adapter(folder, preset, root / "adapters" / n) for n, folder in adapters.items()}
        rows["export_llm"] = []
    for n in counts:
        found = {"llm-exporters": export_ours(overrides, {k: adapters[k] for k in names[:n]}, out / f"adapters_{n}")}
        if args.export_llm:
            found["export_llm"] = export_theirs(llm_overrides, {k: converted[k] for k in names[:n]},
                                                root / f"adapters_{n}")
        measured = measure({e: program for e, (_, program) in found.items()}, reference, tokens, preset.vocab,
                           args.prompt_len, args.steps, args.repeats)
        for exporter, (row, _) in found.items():
            rows[exporter].append({**row, **measured[exporter]})
            print(exporter, json.dumps(rows[exporter][-1]), flush=True)
    report = {**rows, **({"export_llm_adapters": EXPORT_LLM_ADAPTERS} if args.export_llm else {})}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(report_md(report, args.preset + (f" ({args.layers} layers)" if args.layers else ""),
                                             args.quant))
    print((out / "report.md").read_text())


if __name__ == "__main__":
    main()
