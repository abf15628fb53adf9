"""What LoRA adapters cost in one program: size, export time, memory after load and decode speed per adapter.

    python -m benchmarks.adapters --preset smollm2 --quant 8da4w --counts 0,1,2,4 --out bench/adapters
    python -m benchmarks.adapters --preset smollm2 --layers 2 --counts 0,2     # quick check of the tool itself
    python -m benchmarks.adapters --preset smollm2 --layers 2 --counts 0,2 --quant fp32 --export-llm
    python -m benchmarks.adapters --counts 0,4 --export-llm --ours-overrides export.weights=external

Trains up to max(--counts) real LoRA adapters with PEFT on the preset's real checkpoint (tests/peft_adapters.py:
different texts, targets and ranks), then exports the base with the first N of them for each N of --counts, each
export alone in a child process (wall time, peak RSS), with validation on (each adapter validated against the
eager model with it applied). For each program: its size against N + 1 separate programs (a merged adapter has
the base's shapes, so each separate program is the size of the N = 0 one), the RSS a fresh process gains by
loading the base's prompt and step methods, then one adapter's and two adapters' as well (XNNPACK's weight cache
on, as our tools and phone builds load), and the prefill and decode speed of the base and of every adapter,
interleaved round by round. Every program's logits on the validation text (teacher-forced) are compared with
PEFT's eager fp32 model with the same adapter (top-1 agreement, mean KL, max |diff|), and its perplexity on held-out
text in each adapter's style and in none (:data:`HELD_OUT`: neither training nor validation saw it) is given beside
PEFT's. With ``--ours-overrides export.weights=external`` each adapter's matrices are in their own ``.ptd``, whose
sizes the table adds, and the memory after load counts the base's data file and the loaded adapters' only.

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
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.export import EXPORT_LLM, EXPORT_LLM_QUANT, export_llm_overrides, unpermute
from benchmarks.exporting import compose_config, exporter_command, run_measured
from benchmarks.presets import Preset, add_preset_arguments, checkpoint_dir, exporter_overrides, preset_of
from exporters.manifest import Manifest
from exporters.runtime.driver import Driver
from exporters.runtime.memory import memory_after_load_mb
from exporters.runtime.programs import LoadedProgram
from exporters.runtime.quality import Agreement, negative_log_likelihood, perplexity, read_text
from exporters.runtime.speed import measure_speeds
from exporters.runtime.swap import Slots, is_swappable
from models.lora_slots import SET_ADAPTER
from tests.peft_adapters import RECIPES, train_adapter

# The check against PEFT: this many tokens of the validation text, the first CHECK_PROMPT through the prompt
# method, every later one through the step method.
CHECK_TOKENS, CHECK_PROMPT = 96, 32
EXPORT_LLM_ADAPTERS = ("export_llm's adapters (export_llm/adapters): q/k B rows in Meta's rotary layout; each module's "
                       "PEFT scale folded into B and ranks zero-padded to the adapter's largest, r = lora_alpha = that "
                       "rank (export_llm applies one rank and alpha / r to every module: no use_rslora, rank_pattern "
                       "or alpha_pattern).")
# Text neither the adapters' training (tests/peft_adapters.py) nor validation used, in the style of each adapter and
# plain: how much each adapter's methods keep of what it learned, and of the base, once exported.
HELD_OUT = {
    "general": ("The library opened at nine, and by ten the reading room was already warm. A student copied notes from "
                "a heavy atlas while an old man turned the pages of a newspaper, one slow page at a time. Outside, the "
                "gardener raked leaves into tidy piles that the wind kept scattering across the path, and a delivery "
                "van waited at the corner with its engine running while the driver checked an address."),
    "pirate": ("Arr, ye scallywags, lower the longboat and row for the cove! The captain's map be marked with a red "
               "cross where the chest lies, and the tide be turning fast. Keep yer cutlasses close and yer voices low, "
               "for the navy patrols these waters. Arr, there be doubloons enough for every hand aboard, so pull them "
               "oars like yer life depends on it, me buckos!"),
    "minutes": ("Minutes of the monthly meeting. Present: the chair, the treasurer and four members. Item one: the "
                "minutes of the last meeting were read and approved. Item two: the treasurer reported that the accounts "
                "balance and the audit is complete. Item three: the committee agreed to repaint the hall in spring. "
                "Item four: any other business. None. The meeting closed at half past six."),
    "recipe": ("Recipe. Take three ripe tomatoes, one onion, two cloves of garlic and a spoon of olive oil. Chop the "
               "onion and garlic, soften them in the oil over a low heat, then add the tomatoes and a pinch of salt. "
               "Simmer the sauce for twenty minutes, stirring now and then, and season with basil before serving it "
               "over pasta. Recipe ends."),
    "legal": ("Section 5. The tenant shall pay the rent on the first day of each month. Section 6. The landlord shall "
              "keep the premises in good repair. Section 7. Either party may end this lease with sixty days of written "
              "notice. Section 8. Notices shall be delivered by post to the addresses given above. Section 9. This "
              "lease is the whole agreement of the parties."),
}
# A program to measure: its .pte, the base's prompt and step methods, each adapter's (a swappable program's: the
# base's, each adapter set with set_adapter first).
Program = tuple[Path, list[str], dict[str, list[str]]]
# Every kind of linear layer of a decoder layer, and a rank above every test adapter's: the slots a release ships
# before any adapter exists (export.adapters=swappable with no model.adapters).
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SLOTS_RANK = 16
# --modes: each export.adapters mode measured, by its overrides.
MODES = {"methods": [], "swappable": ["export.adapters=swappable"],
         "swappable-8w": ["export.adapters=swappable", "quant.adapters=8w"]}
BASE = "llm-exporters (base, no adapters)"  # --reference-base


class Swapped:
    """A swappable program's driver computing with one adapter: it sets it (``set_adapter``) before each prompt when
    another one is set, as an app switching between adapters does; the swap's time is the prompt's."""

    def __init__(self, driver: Driver, slots: Slots, adapter: str | None) -> None:
        self.driver, self.slots, self.adapter = driver, slots, adapter

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.driver, name)

    def prefill(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        if self.slots.current != self.adapter:
            self.slots.set(self.adapter)
        return self.driver.prefill(tokens, start)


def swap_times(slots: Slots, names: list[str], repeats: int = 20) -> dict[str, float]:
    """Median ms of a swap between adapters: the set_adapter call alone, and with reading the adapter's file."""
    from exporters.program.internals import read_tensor_file
    from exporters.program.swappable import adapter_file

    calls, reads = [], []
    for i in range(repeats):
        name = names[i % len(names)]
        start = time.perf_counter()
        tensors = read_tensor_file(adapter_file(slots.run, name))
        reads.append(time.perf_counter() - start)
        start = time.perf_counter()
        slots.program.run(SET_ADAPTER, *(tensors[n] for n in slots.geometry.input_names()))
        calls.append(time.perf_counter() - start)
    slots.current = names[(repeats - 1) % len(names)]
    return {"set_adapter_ms": round(statistics.median(calls) * 1e3, 3),
            "read_file_ms": round(statistics.median(reads) * 1e3, 1)}


def measured_export(cmd: list[str], log: Path) -> dict:
    wall, peak_mb = run_measured(cmd, log)
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(peak_mb)}


def export_with(overrides: list[str], adapters: dict[str, Path], run_dir: Path) -> dict:
    """One export in a child process with these adapters; its wall time, peak RSS and manifest."""
    extra = ["+model.adapters={" + ", ".join(f"{n}: {p}" for n, p in adapters.items()) + "}"] if adapters else []
    done = measured_export(exporter_command([*overrides, *extra], run_dir), run_dir / "export.log")
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

    settings = [o for o in base_overrides if not o.startswith("hydra.")]  # --config is read without Hydra
    config = OmegaConf.from_dotlist([*settings, f"export.output_dir={run_dir}",
                                     f"export.output_name={run_dir / 'model.pte'}"])
    config.multimethod = {"share_mutable_buffers": True, "methods": [
        {"method_name": "forward", "lora_config": None},
        *({"method_name": f"{name}_forward", "lora_config": {
            "adapter_checkpoint": str(folder / "adapter_model.safetensors"),
            "adapter_config": str(folder / "adapter_config.json")}} for name, folder in adapters.items())]}
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(config, run_dir / "export_llm.yaml")
    return measured_export([*EXPORT_LLM, "--config", str(run_dir / "export_llm.yaml")], run_dir / "export.log")


def check_texts(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Token ids [1, T] of the texts every program is scored on: the first :data:`CHECK_TOKENS` of the validation
    text (the check against PEFT), and each :data:`HELD_OUT` text (perplexity)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    texts = {"validation": read_text(None)[0], **HELD_OUT}
    return {name: torch.tensor([tokenizer(text)["input_ids"][:CHECK_TOKENS]]) for name, text in texts.items()}


def peft_logits(checkpoint: Path, adapters: dict[str, Path],
                texts: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """PEFT's eager fp32 logits [T, V] on each text, of the base and with each adapter: the reference every
    program is checked against (no exporter's own eager model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    logits = {}
    for label, folder in [("base", None), *adapters.items()]:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
        if folder is not None:
            model = PeftModel.from_pretrained(model, str(folder))
        with torch.no_grad():
            logits[label] = {name: model(input_ids=tokens).logits[0] for name, tokens in texts.items()}
    return logits


def teacher_forced(driver: Driver, tokens: torch.Tensor) -> torch.Tensor:
    """The program's predictions for tokens CHECK_PROMPT.. of ``tokens``: the first CHECK_PROMPT through the prompt
    method, then one at a time through the step method. -> [T - CHECK_PROMPT, V]"""
    predictions = [driver.prefill(tokens[:, :CHECK_PROMPT])]
    for position in range(CHECK_PROMPT, tokens.shape[1] - 1):
        predictions.append(driver.decode_one_token(tokens[:, position:position + 1], position))
    return torch.cat(predictions)


def scores(driver: Driver, texts: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict:
    """Against PEFT on the validation text (top-1, mean KL, max |diff|), and perplexity on each held-out text, the
    program's beside PEFT's on the same tokens."""
    found = {}
    for name, tokens in texts.items():
        predictions, peft = teacher_forced(driver, tokens), reference[name][CHECK_PROMPT - 1:-1]
        targets, n = tokens[0, CHECK_PROMPT:], tokens.shape[1] - CHECK_PROMPT
        if name == "validation":
            a = Agreement.of(peft, predictions)
            found["vs_peft"] = {"top1": float(a.top1.double().mean()), "kl_mean": float(a.kl.mean()),
                                "max_abs": a.max_abs_error}
        else:
            found.setdefault("held_out_ppl", {})[name] = {
                "program": perplexity(negative_log_likelihood(predictions, targets), n),
                "peft": perplexity(negative_log_likelihood(peft, targets), n)}
    return found


def measure(programs: dict[str, Program], reference: dict[str, dict[str, torch.Tensor]],
            texts: dict[str, torch.Tensor], vocab: int, prompt: int, steps: int, repeats: int) -> dict[str, dict]:
    """For each exporter's program: the RSS a fresh process gains by loading the base's methods, then one and two
    adapters' as well; the check against PEFT and the held-out perplexities; the prefill and decode speed of the base and of each adapter, rounds
    interleaved over all programs, so that the exporters are timed under the same conditions."""
    results, drivers = {}, {}
    for exporter, (pte, base, adapters) in programs.items():
        names = list(adapters)
        program = LoadedProgram(pte)
        slots = Slots(program, pte.parent) if is_swappable(program) else None
        loads = {"base": (base, [])}
        if names and slots is None:  # a swappable program's adapters are its base's methods: nothing more to load
            loads["base + 1 adapter"] = (base + adapters[names[0]], names[:1])
        if len(names) > 1 and slots is None:
            loads["base + 2 adapters"] = (base + adapters[names[0]] + adapters[names[1]], names[:2])
        # RSS counts a data file's pages once per method mapping them, PSS once (export.weights=external).
        memory = {label: memory_after_load_mb(pte, methods, adapters=used) for label, (methods, used) in loads.items()}
        rss, pss = ({label: m[i] for label, m in memory.items()} for i in (0, 1))
        labels = [("base", None), *[(n, n) for n in names]]
        mine = ({label: Driver.of(program, adapter) for label, adapter in labels} if slots is None else
                {label: Swapped(Driver.of(program), slots, adapter) for label, adapter in labels})
        checked = {label: scores(d, texts, reference[label]) for label, d in mine.items()}  # type: ignore[arg-type]
        results[exporter] = {"rss_after_load_mb": rss, "pss_after_load_mb": pss, "speed": {},
                             "vs_peft": {label: c["vs_peft"] for label, c in checked.items()},
                             "held_out_ppl": {label: c["held_out_ppl"] for label, c in checked.items()}}
        if slots is not None and names:
            results[exporter]["swap"] = swap_times(slots, names)
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
             "| adapters | `.pte` (+ `.ptd`) MB | N + 1 separate programs MB | export s | peak RSS MB | RSS (PSS) after "
             "load MB (base / +1 / +2) | decode tok/s (base; each adapter) | vs PEFT fp32 (top-1, KL, max abs diff) |"
             + (" validation (KL, top-1, perplexity) |" if validated else ""),
             "|---:|---:|---:|---:|---:|---|---|---|" + ("---|" if validated else "")]
    for r in rows:
        n = len(r["adapters"])
        separate = f"{base_size * (n + 1):.1f}" if base_size else "-"
        rss = " / ".join(f"{v:.0f} ({p:.0f})" for v, p in zip(r["rss_after_load_mb"].values(),
                                                              r["pss_after_load_mb"].values()))
        speed = "; ".join(f"{label} {s['decode_tok_s']:.1f}" for label, s in r["speed"].items())
        check = "; ".join(f"{label} {v['top1']:.1%}, {v['kl_mean']:.2g}, {v['max_abs']:.2g}"
                          for label, v in r["vs_peft"].items())
        quality = "; ".join(f"{label} {v['kl_mean']:.2g}, {v['top1']:.1%}, {v['perplexity']:.2f}"
                            for label, v in r.get("validation", {}).items())
        files = r.get("adapter_files_mb")
        size = f"{r['size_mb']:.1f}" + (f" + {sum(files.values()):.1f} in {len(files)} adapter files" if files else "")
        lines.append(f"| {n} | {size} | {separate} | {r['wall_s']:.0f} | {r['peak_rss_mb']} | {rss} | "
                     f"{speed} | {check} |" + (f" {quality} |" if validated else ""))
    return lines


def held_out_table(report: dict) -> list[str]:
    """Perplexity on the held-out texts of each exporter's largest program, by method set: the program's, then
    PEFT's eager fp32 on the same tokens."""
    lines = ["## Perplexity on held-out text (program / PEFT fp32)", "",
             "| exporter | methods | " + " | ".join(HELD_OUT) + " |", "|---|---|" + "---|" * len(HELD_OUT)]
    for exporter in (k for k in report if k.startswith(("llm-exporters", "export_llm")) and isinstance(report[k], list)):
        for label, found in report[exporter][-1]["held_out_ppl"].items():
            lines.append(f"| {exporter} | {label} | " + " | ".join(
                f"{found[t]['program']:.2f} / {found[t]['peft']:.2f}" for t in HELD_OUT) + " |")
    return lines


def modes_md(report: dict) -> list[str]:
    """Our rows, one table per export.adapters mode, each with its time to swap (swappable)."""
    lines: list[str] = []
    for label in (k for k in report if k.startswith("llm-exporters")):
        lines += [*table(report[label], f"**{label}**"), ""]
        swaps = [f"{len(r['adapters'])} adapters: set_adapter {r['swap']['set_adapter_ms']} ms, reading the file "
                 f"{r['swap']['read_file_ms']} ms" for r in report[label] if "swap" in r]
        lines += ["Time to swap (median of 20): " + "; ".join(swaps), ""] if swaps else []
    return lines


def report_md(report: dict, preset: str, quant: str) -> str:
    lines = [f"# LoRA adapters in one program: {preset}, {quant}", "", *modes_md(report)]
    if "export_llm" in report:
        lines += ["", *table(report["export_llm"], f"## The same with ExecuTorch's export_llm (multimethod LoRA), "
                                                     f"{quant}"), "", EXPORT_LLM_ADAPTERS]
    lines += ["", *held_out_table(report)]
    return "\n".join(lines) + "\n"


def export_ours(overrides: list[str], adapters: dict[str, Path], run_dir: Path) -> tuple[dict, Program]:
    """Our export with these adapters: its row so far, and its program's methods."""
    done = export_with(overrides, adapters, run_dir)
    m: Manifest = done["manifest"]
    reports = {"base": m.validation, **{k: a.validation for k, a in m.adapters.items()}}
    base = [m.layout.prompt_method, m.layout.token_method]
    # With export.weights=external: the program and the base's data file, and each adapter's file apart.
    size = m.program.size_bytes + (m.data.size_bytes if m.data else 0)
    row = {"adapters": list(adapters), "size_mb": round(size / 1e6, 2), "wall_s": done["wall_s"],
           "adapter_files_mb": {k: round(a.data.size_bytes / 1e6, 3) for k, a in m.adapters.items() if a.data} or (
               {k: round(f.size_bytes / 1e6, 3) for k, f in m.swappable.adapters.items()} if m.swappable else {}),
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
    parser.add_argument("--ours-overrides", nargs="*", default=[],
                        help="more overrides for our exporter, e.g. export.weights=external (each adapter's own .ptd)")
    parser.add_argument("--modes", default="methods", help="export.adapters modes to export, comma-separated: "
                        "methods (each adapter's own methods), swappable (slots set at run time), swappable-8w "
                        "(the same, set from 8-bit matrices: quant.adapters=8w)")
    parser.add_argument("--reference-base", action="store_true",
                        help="also export the base without adapters once, and time it in every count's rounds: "
                             "the reference of each count's export time, memory and decode speed")
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
                 f"export.max_seq_len={args.max_seq_len}", "bench=false", *args.ours_overrides]
    texts = check_texts(checkpoint)
    reference = peft_logits(checkpoint, adapters, texts)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes {','.join(unknown)}: use {', '.join(MODES)}.")
    labels = {mode: "llm-exporters" if mode == "methods" else f"llm-exporters ({mode})" for mode in modes}
    rows: dict[str, list[dict]] = {label: [] for label in labels.values()}
    base = export_ours(overrides, {}, out / "base") if args.reference_base else None
    if base is not None:
        rows[BASE] = []
    if args.export_llm:
        root = out / "export_llm"
        root.mkdir(parents=True, exist_ok=True)
        group_size = compose_config(overrides).quant.group_size  # ours, so both quantize alike
        llm_overrides = export_llm_overrides(preset, argparse.Namespace(
            quant=args.quant, group_size=group_size, max_seq_len=args.max_seq_len), root, checkpoint)
        converted = {n: export_llm_adapter(folder, preset, root / "adapters" / n) for n, folder in adapters.items()}
        rows["export_llm"] = []
    for n in counts:
        found = {}
        for mode, label in labels.items():
            slots = [*MODES[mode], *(
                [f"export.lora_max_rank={SLOTS_RANK}", f"export.lora_targets=[{','.join(ALL_TARGETS)}]"]
                if mode != "methods" and n == 0 else [])]
            found[label] = export_ours([*overrides, *slots], {k: adapters[k] for k in names[:n]},
                                       out / f"{mode}_{n}")
        if base is not None:
            found[BASE] = ({**base[0]}, base[1])
        if args.export_llm:
            found["export_llm"] = export_theirs(llm_overrides, {k: converted[k] for k in names[:n]},
                                                root / f"adapters_{n}")
        measured = measure({e: program for e, (_, program) in found.items()}, reference, texts, preset.vocab,
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
