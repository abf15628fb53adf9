"""Benchmark our exporter against ExecuTorch's own ``export_llm`` on the same architecture, same run.

    python scripts/bench_export.py                       # 134M Llama, xnnpack 8da4w, max_seq_len 256
    python scripts/bench_export.py --preset tiny         # quick check of the script itself

For each exporter: wall time and peak RSS of the export process (os.wait4 on the child), .pte size,
then decode and prefill tokens/s of the written program in the ExecuTorch runtime (median of
repeats). Numbers are reported as ratios against export_llm measured in the same run, because
absolute times on a shared 2-core machine drift. Writes a JSON report next to the programs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PRESETS = {
    # The 134M-parameter Llama of DESIGN.md: dim 768, 12 layers, 12 heads, vocab 32000, untied.
    "134m": {"dim": 768, "hidden": 2048, "layers": 12, "heads": 12, "kv_heads": 12, "vocab": 32000},
    "tiny": {"dim": 64, "hidden": 256, "layers": 2, "heads": 4, "kv_heads": 4, "vocab": 512},
}


def run_measured(cmd: list[str], log: Path) -> dict[str, float]:
    start = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"command failed ({log}):\n  {' '.join(cmd)}\n" + log.read_text()[-3000:])
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(usage.ru_maxrss / 1024**2, 2)}


def ours_cmd(p: dict, args: argparse.Namespace, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "exporters.llm", "model=llama", "model.random_init=true",
        f"model.arch.hidden_size={p['dim']}", f"model.arch.intermediate_size={p['hidden']}",
        f"model.arch.num_hidden_layers={p['layers']}", f"model.arch.num_attention_heads={p['heads']}",
        f"model.arch.num_key_value_heads={p['kv_heads']}", f"model.arch.vocab_size={p['vocab']}",
        "model.arch.tie_word_embeddings=false", f"quant={args.quant}", f"quant.group_size={args.group_size}",
        f"export.max_seq_len={args.max_seq_len}", f"hydra.run.dir={out}", *args.ours_overrides,
    ]


def export_llm_cmd(p: dict, args: argparse.Namespace, out: Path) -> list[str]:
    params = out / "params.json"
    params.write_text(json.dumps({
        "dim": p["dim"], "n_layers": p["layers"], "n_heads": p["heads"], "n_kv_heads": p["kv_heads"],
        "vocab_size": p["vocab"], "hidden_dim": p["hidden"], "norm_eps": 1e-5, "rope_theta": 10000.0,
    }))
    return [
        sys.executable, "-m", "executorch.extension.llm.export.export_llm", f"base.params={params}",
        "model.use_kv_cache=True", "model.use_sdpa_with_kv_cache=True", "model.enable_dynamic_shape=True",
        "backend.xnnpack.enabled=True", f"quantization.qmode={args.quant}",
        f"quantization.group_size={args.group_size}", f"export.max_seq_length={args.max_seq_len}",
        f"export.max_context_length={args.max_seq_len}", f"export.output_dir={out}", f"export.output_name={out / 'model.pte'}",
    ]


def tokens_per_second(pte: Path, prefill_method: str, decode_method: str, prefill_len: int, vocab: int,
                      decode_steps: int, repeats: int) -> dict[str, float]:
    """Median decode and prefill throughput of a program in the ExecuTorch runtime."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (kernels for export_llm's sdpa)
    from executorch.runtime import Runtime

    decode_rates, prefill_rates = [], []
    for r in range(repeats):
        program = Runtime.get().load_program(str(pte))  # fresh program: an empty KV cache
        prefill, decode = program.load_method(prefill_method), program.load_method(decode_method)
        prompt = torch.randint(0, vocab, (1, prefill_len), generator=torch.Generator().manual_seed(r))
        t = time.perf_counter()
        logits = prefill.execute([prompt, torch.tensor([0])])[0]
        prefill_rates.append(prefill_len / (time.perf_counter() - t))
        t = time.perf_counter()
        for i in range(decode_steps):
            token = logits.reshape(-1, logits.shape[-1])[-1].argmax().view(1, 1)
            logits = decode.execute([token, torch.tensor([prefill_len + i])])[0]
        decode_rates.append(decode_steps / (time.perf_counter() - t))
    return {"decode_tok_s": round(statistics.median(decode_rates), 1),
            "prefill_tok_s": round(statistics.median(prefill_rates), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="134m")
    ap.add_argument("--quant", default="8da4w")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="folder for programs and the report")
    ap.add_argument("--ours-overrides", nargs="*", default=[], help="extra Hydra overrides for our exporter")
    args = ap.parse_args()
    p = PRESETS[args.preset]
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_export_"))
    results = {}
    for name, build, methods in (("export_llm", export_llm_cmd, ("forward", "forward")),
                                 ("llm-exporters", ours_cmd, ("prefill", "decode"))):
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        print(f"exporting with {name} ...", flush=True)
        row = run_measured(build(p, args, out), out / "export.log")
        pte = out / "model.pte"
        row["pte_mb"] = round(pte.stat().st_size / 1e6, 1)
        row.update(tokens_per_second(pte, *methods, args.prefill_len, p["vocab"], args.decode_steps, args.repeats))
        results[name] = row
        print(f"  {row}", flush=True)
    ref = results["export_llm"]
    ratios = {k: round(results["llm-exporters"][k] / ref[k], 2) for k in ref}
    report = {"preset": args.preset, "architecture": p, "quant": args.quant, "group_size": args.group_size,
              "max_seq_len": args.max_seq_len, "results": results, "ours_over_export_llm": ratios}
    (root / "report.json").write_text(json.dumps(report, indent=2))
    print(f"\n| exporter | wall s | peak RSS GB | .pte MB | decode tok/s | prefill tok/s ({args.prefill_len}) |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['wall_s']} | {r['peak_rss_gb']} | {r['pte_mb']} | {r['decode_tok_s']} | {r['prefill_tok_s']} |")
    print(f"| ratio ours/export_llm | {ratios['wall_s']} | {ratios['peak_rss_gb']} | {ratios['pte_mb']} | "
          f"{ratios['decode_tok_s']} | {ratios['prefill_tok_s']} |")
    print(f"\nreport: {root / 'report.json'}")


if __name__ == "__main__":
    main()
