"""Benchmark our exporter against ExecuTorch's own ``export_llm`` on the same model, in the same run.

    python -m benchmarks.export --out bench/134m          # 134M Llama shape, xnnpack 8da4w, max_seq_len 256
    python -m benchmarks.export --preset smollm2 --out bench/smollm2   # the real SmolLM2-135M-Instruct
    python -m benchmarks.export --preset 1b --quant 8da4w_emb4w --out bench/1b   # Llama-3.2-1B shape, random weights
    python -m benchmarks.export --preset tiny             # quick check of the tool itself (a minute)
    python -m benchmarks.export --preset qwen3.5-0.8b --quant fp32 --export-llm-static --out bench/qwen3.5
                                                          # export_llm's Qwen3.5 path: fp32, static shapes
    python -m benchmarks.export --preset smollm2 --validate --peers optimum-executorch transformers \
        --optimum-python <venv>/bin/python                 # every peer on the real model (docs/performance.md)

For each exporter: wall time and peak RSS of the export process (os.wait4 on the child), .pte size (and
.ptd with ``--ours-overrides export.weights=external``), RSS of a fresh process after loading the program's
methods with XNNPACK's weight cache on (as our tools and ExecuTorch's phone builds load) and off (the pip
runtime's default), then decode and prefill tokens/s of the written programs in the ExecuTorch runtime
(median of repeats; ours also without the weight cache), measured after both exports, all programs
loaded in one process and timed round by round in alternating order, so all run under the same
conditions. Numbers are reported as ratios against export_llm measured in the same run, because
absolute times on a shared 2-core machine drift. The presets are benchmarks/presets.py's. Our exporter runs with
validate=false (export_llm does not validate; --validate adds it). Writes report.json and report.md next
to the programs (``--out``, default a new temporary folder). Measure alone: two heavy exports at once distort
each other's numbers. ``python -m benchmarks.cost_curve`` tabulates and plots several reports.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.exporting import exporter_command, run_measured_or_failed
from benchmarks.presets import Preset, add_preset_arguments, checkpoint_dir, exporter_overrides, preset_of
from exporters.manifest import Manifest
from exporters.runtime.driver import Driver
from exporters.runtime.memory import memory_after_load_mb, rss_after_load_mb
from exporters.runtime.programs import LoadedProgram
from exporters.runtime.speed import measure_speeds

NO_CACHE = "llm-exporters (no weight cache)"


# export_llm's spelling of our quant options.
EXPORT_LLM_QUANT = {
    "fp32": [],
    "8da4w": ["quantization.qmode=8da4w"],
    "8da8w": ["quantization.qmode=8da8w"],
    "8da4w_emb4w": ["quantization.qmode=8da4w", "quantization.embedding_quantize='4,32'"],
}


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a Hugging Face q/k projection (or of a LoRA B feeding one) in Meta's rotary layout: each head's
    rows interleaved (x0, y0, x1, y1, ...) where Hugging Face puts its halves one after the other."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def meta_checkpoint(hf_dir: Path, p: Preset, out: Path) -> Path:
    """The real weights in Meta's names, for export_llm: a Llama's q/k rows un-permuted into Meta's rotary layout; a
    Qwen2's as they are, with their biases (its params.json says ``use_hf_rope``), as ExecuTorch's
    ``examples/models/qwen2_5/convert_weights.py`` maps them (that script needs torchtune, which is not installed)."""
    from safetensors.torch import load_file

    hf = load_file(str(hf_dir / "model.safetensors"))
    sd = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    sd["output.weight"] = hf.get("lm_head.weight", sd["tok_embeddings.weight"])
    names = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
             "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
             "post_attention_layernorm": "ffn_norm"}
    hf_rope = p.export_llm_params().get("use_hf_rope", False)
    for i in range(p.layers):
        for hf_name, meta_name in names.items():
            w = hf[f"model.layers.{i}.{hf_name}.weight"]
            if hf_name in ("self_attn.q_proj", "self_attn.k_proj") and not hf_rope:
                w = unpermute(w, p.heads if hf_name == "self_attn.q_proj" else p.kv_heads)
            sd[f"layers.{i}.{meta_name}.weight"] = w
            if f"model.layers.{i}.{hf_name}.bias" in hf:
                sd[f"layers.{i}.{meta_name}.bias"] = hf[f"model.layers.{i}.{hf_name}.bias"]
    path = out / "consolidated.pth"
    torch.save(sd, path)
    return path


# optimum-executorch's spelling of our quant options (its CLI's --qlinear / --qembedding).
OPTIMUM_QUANT = {
    "fp32": [],
    "8da4w": ["--qlinear", "8da4w", "--qlinear_group_size", "{group}"],
    "8da8w": ["--qlinear", "8da8w"],
    "8da4w_emb4w": ["--qlinear", "8da4w", "--qlinear_group_size", "{group}", "--qembedding", "4w",
                    "--qembedding_group_size", "32"],
}


def optimum_cmd(p: Preset, args: argparse.Namespace, out: Path, hf_dir: Path) -> list[str]:
    """optimum-executorch's CLI (from its own environment: it pins another transformers), writing ``out/model.pte``
    with ExecuTorch's custom SDPA and KV cache, as its README recommends for XNNPACK."""
    if args.optimum_python is None:
        raise SystemExit("--peers optimum-executorch needs --optimum-python: the python of a venv with "
                         "optimum-executorch installed (docs/performance.md says how to make one)")
    quant = [a.format(group=args.group_size) for a in OPTIMUM_QUANT[args.quant]]
    return [str(args.optimum_python.parent / "optimum-cli"), "export", "executorch", "--model", str(hf_dir),
            "--task", "text-generation", "--recipe", "xnnpack", "--use_custom_sdpa", "--use_custom_kv_cache",
            *quant, "--max_seq_len", str(args.max_seq_len), "--output_dir", str(out)]


TRANSFORMERS = "transformers"
TRANSFORMERS_QUANT = ("8da4w", "fp32")  # what benchmarks.transformers_exporter quantizes as a transformers user would


def transformers_cmd(p: Preset, args: argparse.Namespace, out: Path, hf_dir: Path) -> list[str]:
    """transformers' own ExecuTorch exporter (``benchmarks.transformers_exporter``): prefill.pte and decode.pte."""
    if not p.real:
        raise SystemExit("--peers transformers needs a checkpoint with a tokenizer (its exporter traces a tokenized "
                         "prompt): use --preset smollm2.")
    if args.quant not in TRANSFORMERS_QUANT:
        raise SystemExit(f"--peers transformers: its exporter takes --quant {' or '.join(TRANSFORMERS_QUANT)}, "
                         f"not {args.quant}.")
    return [sys.executable, "-m", "benchmarks.transformers_exporter", "export", "--checkpoint", str(hf_dir),
            "--out", str(out), "--max-seq-len", str(args.max_seq_len), "--quant", args.quant,
            "--group-size", str(args.group_size)]


def transformers_row(out: Path, hf_dir: Path, args: argparse.Namespace) -> dict:
    """The measurements of transformers' programs, through its own runner (its KV cache is program input and output,
    which this project's driver does not carry): sizes, RSS after loading both, decode and prefill tok/s after a
    ``--prefill-len``-token prompt (one prefill call, not a median: its runner times one generation), perplexity on
    the same tokens as the others, and the stock runner on its decode program."""
    from tokenizers import Tokenizer

    programs = [out / "prefill.pte", out / "decode.pte"]
    row: dict = {"pte_mb": round(sum(f.stat().st_size for f in programs) / 1e6, 1),
                 "rss_after_load_mb": round(sum(memory_after_load_mb(f, ["forward"])[0] for f in programs), 1)}
    tool = [sys.executable, "-m", "benchmarks.transformers_exporter"]
    prompt = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).decode(text_ids(args.text, hf_dir, args.prefill_len))
    gen = json.loads(subprocess.run(
        [*tool, "generate", "--exported", str(out), "--checkpoint", str(hf_dir), "--prompt", prompt,
         "--max-new-tokens", str(args.decode_steps + 3), "--no-compare-eager"],
        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    row.update(decode_tok_s=gen["decode_tok_s"], prefill_tok_s=round(gen["prompt_tokens"] / gen["prefill_s"], 1),
               prefill_path=gen["prompt_path"])
    ppl = json.loads(subprocess.run(
        [*tool, "perplexity", "--exported", str(out), "--checkpoint", str(hf_dir), "--text", str(args.text),
         "--no-bos", "--prompt-tokens", "1", "--max-tokens", str(args.ppl_tokens - 1), "--no-compare-eager"],
        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    row["perplexity"] = round(ppl["perplexity"], 3)
    row["stock_runner"] = stock_runner_text(out / "decode.pte", hf_dir)
    return row


def ours_cmd(p: Preset, args: argparse.Namespace, out: Path, hf_dir: Path) -> list[str]:
    return exporter_command([*exporter_overrides(p, hf_dir), f"quant={args.quant}",
                             f"quant.group_size={args.group_size}", f"export.max_seq_len={args.max_seq_len}",
                             f"validate={str(args.validate).lower()}", *args.ours_overrides], out)


EXPORT_LLM = [sys.executable, "-m", "executorch.extension.llm.export.export_llm"]


def export_llm_cmd(p: Preset, args: argparse.Namespace, out: Path, hf_dir: Path) -> list[str]:
    return [*EXPORT_LLM, *export_llm_overrides(p, args, out, hf_dir)]


def export_llm_overrides(p: Preset, args: argparse.Namespace, out: Path, hf_dir: Path) -> list[str]:
    """export_llm's settings for ``p`` (params.json and, for real weights, the Meta checkpoint written into
    ``out``), writing ``out/model.pte``."""
    params = out / "params.json"
    params.write_text(json.dumps(p.export_llm_params()))
    checkpoint = ([f"base.checkpoint={meta_checkpoint(hf_dir, p, out)}", f"base.metadata='{token_metadata(hf_dir)}'"]
                  if p.real else [])
    return [
        f"base.params={params}", *checkpoint,
        "model.use_kv_cache=True", "model.use_sdpa_with_kv_cache=True",
        f"model.enable_dynamic_shape={not args.export_llm_static}",
        "backend.xnnpack.enabled=True", *EXPORT_LLM_QUANT[args.quant],
        f"quantization.group_size={args.group_size}", f"export.max_seq_length={args.max_seq_len}",
        f"export.max_context_length={args.max_seq_len}", f"export.output_dir={out}",
        f"export.output_name={out / 'model.pte'}",
        # export_llm is a Hydra app too: its run folder (log, composed config) beside its program, not outputs/<date>/.
        f"hydra.run.dir={out / 'hydra'}",
    ]


def token_metadata(hf_dir: Path) -> str:
    """export_llm's ``base.metadata`` for a real checkpoint: its bos and eos ids (the runner's stop tokens), read as
    our exporter reads them, spelled as ExecuTorch's own qwen2_5 configs; export_llm's defaults are Llama 3's."""
    from models.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(hf_dir, need_weights=False)
    return json.dumps({"get_bos_id": checkpoint.bos_id, "get_eos_ids": checkpoint.eos_ids})


RUNNER_PROMPT = "The capital of France is"


def program_perplexity(pte: Path, hf_dir: Path, text: Path, tokens: int) -> float:
    """Perplexity of the program on the first ``tokens`` tokens of ``text``, one token per step from position 0."""
    from benchmarks.long_context import stepwise_nll

    ids = text_ids(text, hf_dir, tokens)
    nll = stepwise_nll(Driver.of(LoadedProgram(pte, weight_cache=True)), ids)
    return round(math.exp(statistics.fmean(nll)), 3)


def text_ids(text: Path, hf_dir: Path, tokens: int) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(text.read_text()).ids[:tokens]


def stock_runner_text(pte: Path, hf_dir: Path) -> str:
    """What ExecuTorch's stock TextLLMRunner (this environment's release) writes after RUNNER_PROMPT, greedy, 12
    tokens; or how it failed."""
    runner = Path(__file__).resolve().parent.parent / "tests" / "stock_runner.py"
    proc = subprocess.run([sys.executable, str(runner), str(pte), str(hf_dir / "tokenizer.json"), RUNNER_PROMPT,
                           "12"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "rror" in line] or proc.stderr.splitlines()[-1:]
        return f"failed: {errors[-1][:200] if errors else proc.returncode}"
    return json.loads(proc.stdout.strip().splitlines()[-1])["text"]


def undrivable(pte: Path) -> str | None:
    """Why the program's methods cannot prefill and then decode one token at a time (None: they can), e.g.
    export_llm's static-shape Qwen3.5 program, whose one method takes exactly max_seq_len - 1 tokens."""
    from exporters.errors import UserError
    from exporters.runtime.driver import MethodRoles, program_method_shapes

    try:
        MethodRoles.choose(program_method_shapes(LoadedProgram(pte)))
    except UserError as e:
        return str(e)
    return None


def tokens_per_second(ptes: dict[str, tuple[Path, bool]], prefill_len: int, decode_steps: int, repeats: int,
                      vocab: int) -> dict[str, dict[str, float]]:
    """Median steady-state prefill and decode throughput of each program (label -> .pte, weight cache), driven
    as exporters.generate drives it (ours: prefill then decode_one_token; export_llm's: forward for both),
    rounds interleaved."""
    drivers = {name: Driver.of(LoadedProgram(pte, weight_cache=cache)) for name, (pte, cache) in ptes.items()}
    speeds = measure_speeds(drivers, prefill_len, decode_steps, repeats, vocab)
    return {name: {"decode_tok_s": s.decode_tokens_per_s, "prefill_tok_s": s.prefill_tokens_per_s}
            for name, s in speeds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset_arguments(ap, default="134m")
    ap.add_argument("--quant", choices=sorted(EXPORT_LLM_QUANT), default="8da4w")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--validate", action="store_true", help="let our exporter validate too (export_llm does not)")
    ap.add_argument("--export-llm-static", action="store_true",
                    help="export_llm with static shapes (its only path for Qwen3.5: examples/models/qwen3_5/README.md)")
    ap.add_argument("--only", choices=["export_llm", "llm-exporters", "optimum-executorch", TRANSFORMERS],
                    help="run one exporter (no ratios)")
    ap.add_argument("--out", type=Path, default=None, help="folder for programs and the report")
    ap.add_argument("--ours-overrides", nargs="*", default=[], help="extra Hydra overrides for our exporter")
    ap.add_argument("--peers", nargs="*", default=[], choices=["optimum-executorch", TRANSFORMERS],
                    help="also export with these, in the same run (transformers: its own ExecuTorch exporter, real "
                         "weights, 8da4w or fp32; its programs run through its own runner, after the others)")
    ap.add_argument("--optimum-python", type=Path, default=None,
                    help="python of a venv with optimum-executorch (--peers optimum-executorch)")
    ap.add_argument("--text", type=Path, default=Path(__file__).parent / "data" / "long_text.txt",
                    help="real weights: each program's perplexity on this text, stepping one token at a time "
                         "(default: benchmarks/data/long_text.txt, which neither calibration nor validation reads)")
    ap.add_argument("--ppl-tokens", type=int, default=256, help="tokens of --text scored")
    ap.add_argument("--weight-cache-only", action="store_true",
                    help="skip the runs without XNNPACK's weight cache (each loaded method packs its own copy of the "
                         "weights: at 8B, more than this machine holds beside the other program)")
    args = ap.parse_args()
    p = preset_of(args)
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_export_"))
    root.mkdir(parents=True, exist_ok=True)
    hf_dir = checkpoint_dir(p, root)
    exporters = {"export_llm": (export_llm_cmd, [["forward"]]),
                 "llm-exporters": (ours_cmd, [["prefill", "decode_one_token"], ["prefill", "decode_one_token", "forward"]]),
                 **({"optimum-executorch": (optimum_cmd, [["forward"]])} if "optimum-executorch" in args.peers else {}),
                 **({TRANSFORMERS: (transformers_cmd, [])} if TRANSFORMERS in args.peers else {})}
    results = {}
    for name, (build, loads) in exporters.items():
        if args.only and name != args.only:
            continue
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        print(f"exporting with {name} ...", flush=True)
        wall, peak_mb, failure = run_measured_or_failed(build(p, args, out, hf_dir), out / "export.log")
        row: dict = {"wall_s": round(wall, 1), "peak_rss_gb": round(peak_mb / 1024, 2)}
        if failure is not None:  # a result too (export_llm at 8B): where and how it failed, in the report
            results[name] = {**row, "failed": failure}
            print(f"  {name} failed after {row['wall_s']} s at {row['peak_rss_gb']} GB: {failure}", flush=True)
            continue
        if name == TRANSFORMERS:  # two programs, driven by its own runner
            results[name] = {**row, **transformers_row(out, hf_dir, args)}
            print(f"  {results[name]}", flush=True)
            continue
        pte = out / "model.pte"
        row["pte_mb"] = round(pte.stat().st_size / 1e6, 1)
        if pte.with_suffix(".ptd").is_file():
            row["ptd_mb"] = round(pte.with_suffix(".ptd").stat().st_size / 1e6, 1)
        row["rss_after_load_mb"], row["pss_after_load_mb"] = memory_after_load_mb(pte, loads[0])
        if not args.weight_cache_only:
            row["rss_after_load_no_cache_mb"] = rss_after_load_mb(pte, loads[0], weight_cache=False)
        for methods in loads[1:]:
            row[f"rss_after_load_mb[{'+'.join(methods)}]"] = rss_after_load_mb(pte, methods)
            if not args.weight_cache_only:
                row[f"rss_after_load_no_cache_mb[{'+'.join(methods)}]"] = rss_after_load_mb(pte, methods,
                                                                                           weight_cache=False)
        if name == "llm-exporters":
            row["stages_s"] = Manifest.read(out).timings_s
        results[name] = row
        print(f"  {row}", flush=True)
    print("measuring runtime speed ...", flush=True)
    programs = {name: (root / name / "model.pte", True) for name, row in results.items()
                if "failed" not in row and name != TRANSFORMERS}
    for name in list(programs):
        why = undrivable(programs[name][0])
        if why is not None:  # a result too: its speed is not comparable
            results[name]["speed_not_measured"] = why
            print(f"  {name}: speed not measured: {why}", flush=True)
            del programs[name]
    if "llm-exporters" in programs and not args.weight_cache_only:
        programs[NO_CACHE] = (root / "llm-exporters" / "model.pte", False)
    speeds = tokens_per_second(programs, args.prefill_len, args.decode_steps, args.repeats, p.vocab)
    for name, speed in speeds.items():
        if name == NO_CACHE:
            results["llm-exporters"].update({f"{k}_no_cache": v for k, v in speed.items()})
        else:
            results[name].update(speed)
        print(f"  {name}: {speed}", flush=True)
    if p.real:
        print(f"perplexity on {args.text.name} ...", flush=True)
        for name in [n for n in programs if n != NO_CACHE]:
            results[name]["perplexity"] = program_perplexity(root / name / "model.pte", hf_dir, args.text,
                                                             args.ppl_tokens)
            results[name]["stock_runner"] = stock_runner_text(root / name / "model.pte", hf_dir)
            print(f"  {name}: {results[name]['perplexity']}, runner: {results[name]['stock_runner']!r}", flush=True)
    keys = ("wall_s", "peak_rss_gb", "pte_mb", "rss_after_load_mb", "rss_after_load_no_cache_mb", "decode_tok_s",
            "prefill_tok_s")
    ratios = ({k: round(results["llm-exporters"][k] / results["export_llm"][k], 2) for k in keys
               if k in results["llm-exporters"] and k in results["export_llm"]}
              if not any("failed" in results.get(n, {"failed": 1}) for n in ("llm-exporters", "export_llm")) else {})
    params = p.parameters
    label = (args.preset + (f" ({p.layers} layers)" if args.layers else "")
             + (f" at max_seq_len {args.max_seq_len}" if args.max_seq_len != 256 else ""))
    report = {"preset": label, "architecture": asdict(p), "parameters": params, "quant": args.quant,
              "group_size": args.group_size, "max_seq_len": args.max_seq_len, "prefill_len": args.prefill_len,
              "decode_steps": args.decode_steps, "results": results, "ours_over_export_llm": ratios}
    (root / "report.json").write_text(json.dumps(report, indent=2))
    lines = [f"{label} ({params / 1e6:.1f}M parameters), xnnpack {args.quant} g{args.group_size}, "
             f"max_seq_len {args.max_seq_len}; ours: prefill + decode_one_token + forward"
             f"{'' if args.validate else ' (validate=false)'}", "",
             "| exporter | wall s | peak RSS GB | .pte MB | RSS after load MB (weight cache on) | (off) | "
             f"decode tok/s | prefill tok/s ({args.prefill_len}) |"
             + (f" perplexity ({args.ppl_tokens} tokens of {args.text.name}) | stock runner 1.5.1: "
                f"\"{RUNNER_PROMPT}\" |" if p.real else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if p.real else "")]
    for name, r in results.items():
        if "failed" in r:
            lines.append(f"| {name} | failed after {r['wall_s']} s: {r['failed']} | {r['peak_rss_gb']} | | | | | |")
            continue
        size = (f"{r['pte_mb']}" + (f" + {r['ptd_mb']} .ptd" if "ptd_mb" in r else "")
                + (" (prefill.pte + decode.pte)" if name == TRANSFORMERS else ""))
        lines.append(f"| {name} | {r['wall_s']} | {r['peak_rss_gb']} | {size} | {r['rss_after_load_mb']} | "
                     f"{r.get('rss_after_load_no_cache_mb', '—')} | {r.get('decode_tok_s', '—')} | "
                     f"{r.get('prefill_tok_s', '—')} |"
                     + (f" {r['perplexity']} | {r['stock_runner']!r} |" if p.real else ""))
    if ratios:
        lines.append("| ratio ours/export_llm | " + " | ".join(str(ratios.get(k, "—")) for k in keys) + " |")
    for name, r in results.items():
        if "speed_not_measured" in r:
            lines.append(f"\n{name}: speed not measured: {r['speed_not_measured']}")
    if "decode_tok_s_no_cache" in results.get("llm-exporters", {}):
        ours = results["llm-exporters"]
        lines.append(f"\nours without XNNPACK's weight cache: decode {ours['decode_tok_s_no_cache']} tok/s, prefill "
                     f"{ours['prefill_tok_s_no_cache']} tok/s (with it: {ours['decode_tok_s']}, {ours['prefill_tok_s']})")
    (root / "report.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines) + f"\n\nreport: {root / 'report.json'}, {root / 'report.md'}")


if __name__ == "__main__":
    main()
