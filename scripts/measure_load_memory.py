"""Peak memory of loading a checkpoint, as a multiple of its size on disk.

Writes a random-weight Llama checkpoint of about ``--size-mb`` (sharded like a Hub checkpoint), then
loads it with the exporter's loader (``open_checkpoint`` + ``build_model``) in a fresh process and
reads the kernel's peak-RSS counter twice: right after loading (the weights are copy-on-write views
of the memory-mapped files, so pages not yet read do not count), and after every page of every
weight has been read once (what an export then touches).

    python scripts/measure_load_memory.py                    # bf16, ~540 MB, 3 shards
    python scripts/measure_load_memory.py --dtype fp32 --shards 1

Prints one JSON line: checkpoint bytes S, RSS before loading (after a warm-up load of a tiny
checkpoint), peak RSS while loading and with every weight resident, and
``(peak - before_loading) / S`` for both (the target is <= 1.3).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
import tempfile
from models.checkpoint import build_model, open_checkpoint
from models.tiny import write_tiny_checkpoint
# Warm-up: load a tiny checkpoint first, so every lazy import happens before the baseline.
build_model(open_checkpoint(write_tiny_checkpoint(tempfile.mkdtemp(), train_steps=0)), 16)

from exporters.runtime.memory import current_rss_mb, peak_rss_mb, reset_peak_rss
MB = 1024 * 1024
reset_peak_rss()  # the peak-RSS counter starts again at the current RSS
base = current_rss_mb() * MB
t = time.perf_counter()
model = build_model(open_checkpoint({ckpt!r}), 256)
seconds = time.perf_counter() - t
peak = peak_rss_mb() * MB
for p in model.parameters():  # read one element per 2 KB: every page of every weight becomes resident
    p.detach().reshape(-1)[::512].float().sum()
resident = peak_rss_mb() * MB
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({{"rss_before_loading": base, "peak_rss_loading": peak, "peak_rss_weights_resident": resident,
                  "model_param_bytes": params, "load_seconds": round(seconds, 2)}}))
"""


def write_checkpoint(out: Path, dtype: str, size_mb: int, shards: int) -> int:
    """A Llama config scaled to ``size_mb``, weights in ``shards`` safetensors files plus an index."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    hidden, inter, vocab = 1024, 2816, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((size_mb * 1e6 / torch_dtype.itemsize - fixed) / per_layer))
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=vocab, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"], dtype=str(torch_dtype).removeprefix("torch."))
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(out)

    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (hidden, hidden),
            p + "self_attn.v_proj.weight": (hidden, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        })
    names = list(shapes)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = names[k * len(names) // shards:(k + 1) * len(names) // shards]
        tensors = {n: (torch.randn(shapes[n], generator=gen) * 0.02).to(torch_dtype) for n in part}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: file for n in part})
        del tensors
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--size-mb", type=int, default=540)
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="checkpoint directory (default: a temp dir)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.out or Path(tmp) / "ckpt"
        ckpt.mkdir(parents=True, exist_ok=True)
        size = write_checkpoint(ckpt, args.dtype, args.size_mb, args.shards)
        child = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO), ckpt=str(ckpt))],
                               capture_output=True, text=True, check=True)
        result = json.loads(child.stdout.strip().splitlines()[-1])
    base = result["rss_before_loading"]
    print(json.dumps({
        "dtype": args.dtype, "shards": args.shards, "checkpoint_bytes": size, **result,
        "loading_rss_over_checkpoint": round((result["peak_rss_loading"] - base) / size, 3),
        "resident_rss_over_checkpoint": round((result["peak_rss_weights_resident"] - base) / size, 3),
    }))


if __name__ == "__main__":
    main()
