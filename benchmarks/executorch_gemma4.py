"""ExecuTorch's own Gemma 4 export (``examples/models/gemma4/export_gemma4.py``) on the shape ours exports in
``benchmarks.audio_language gemma4-e2b``: the peer's export time, peak RSS, program size and runtime numbers.

    python -m benchmarks.executorch_gemma4 --out /work/bench/gemma4-e2b-executorch --max-seq-len 800

ExecuTorch's exporter reads weights (no random init), so the shape is saved once with seeded random weights in
bf16 (``--checkpoint``, 9.9 GB, kept outside the repository). The installed wheel ships the exporter without its
``config/e2b_config.json``; the child process reads the variant from the checkpoint's own ``config.json``
(``Gemma4Config.from_json``, whose defaults are E2B's). Settings as close to ours as its flags allow: 8da4w linears
(``--group_size 32``, ours 32), 4-bit embedding tables (its per channel, ours groups of 32), the audio tower at
8da8w (ours: ``quant.audio=auto``), no vision tower (the shape has none), one call of ``--max-seq-len`` tokens.
Writes ``report.json`` into ``--out`` (docs/audio.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.exporting import run_measured_or_failed
from benchmarks.vision import median_seconds

PEER_FLAGS = ["--quantize", "8da4w+emb4", "--group_size", "32", "--audio_quantize", "8da8w", "--no-vision"]
DEFAULT_CHECKPOINT = Path("/work/cache/gemma4-e2b-audio-random")


def write_checkpoint(folder: Path) -> None:
    """``benchmarks.audio_language``'s Gemma 4 E2B shape with seeded random weights, bf16."""
    from transformers import Gemma4ForConditionalGeneration

    from benchmarks.audio_language import gemma4_e2b

    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration._from_config(gemma4_e2b(), torch_dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="2GB")


def export_child(checkpoint: str, output: str, max_seq_len: int) -> None:
    """In the child process: ExecuTorch's ``export_single_pte``, the variant read from the checkpoint."""
    from executorch.examples.models.gemma4 import export_gemma4
    from executorch.examples.models.gemma4.text_decoder.gemma4_config import Gemma4Config

    Gemma4Config.from_config = classmethod(lambda cls, variant="e2b": cls.from_json(f"{checkpoint}/config.json"))
    sys.argv = ["export_gemma4", "--checkpoint_path", checkpoint, "--output_path", output,
                "--max_seq_len", str(max_seq_len), *PEER_FLAGS]
    export_gemma4.main()


def measure(pte: Path, steps: int = 32, repeats: int = 3) -> dict[str, Any]:
    """RSS after load, ``audio_encoder`` on 30 s of frames (its input: [1, 2999, 128] and a mask), decode tok/s."""
    from exporters.runtime.memory import current_rss_mb
    from exporters.runtime.programs import LoadedProgram

    before = current_rss_mb()
    loaded = LoadedProgram(pte)
    loaded.load("audio_encoder", "text_decoder")
    after_load = current_rss_mb()
    frames = torch.randn(1, 2999, 128)
    encode_s = median_seconds(lambda: loaded.run("audio_encoder", frames, torch.ones(1, 2999, dtype=torch.bool)),
                              repeats)
    hidden = loaded.run("audio_encoder", frames, torch.ones(1, 2999, dtype=torch.bool))[0].shape

    def decode() -> None:
        for i in range(steps):
            loaded.run("text_decoder", torch.tensor([[7 + i]]), torch.tensor([16 + i]), torch.zeros(1, 1, 1536))

    decode_s = median_seconds(decode, repeats)
    return {"rss_after_load_mb": round(after_load - before, 1), "audio_encode_ms_30s": round(encode_s * 1e3, 1),
            "audio_positions": int(hidden[1]), "decode_tok_s": round(steps / decode_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--max-seq-len", type=int, default=800)
    parser.add_argument("--export", nargs=2, metavar=("CHECKPOINT", "PTE"), help=argparse.SUPPRESS)
    parser.add_argument("--measure", metavar="PTE", help="only the runtime numbers of this program, as JSON")
    args = parser.parse_args()
    if args.export:
        export_child(*args.export, args.max_seq_len)
        return
    if args.measure:
        print(json.dumps(measure(Path(args.measure))))
        return
    if args.out is None:
        parser.error("give --out")
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.checkpoint / "model.safetensors.index.json").is_file():
        write_checkpoint(args.checkpoint)
    pte = args.out / "gemma4.pte"
    cmd = [sys.executable, "-m", "benchmarks.executorch_gemma4", "--max-seq-len", str(args.max_seq_len),
           "--export", str(args.checkpoint), str(pte)]
    wall, peak, failed = run_measured_or_failed(cmd, args.out / "export.log")
    report: dict[str, Any] = {"peer": "executorch examples/models/gemma4", "flags": PEER_FLAGS,
                              "max_seq_len": args.max_seq_len, "wall_s": round(wall, 1), "peak_rss_mb": round(peak),
                              "failed": failed}
    if failed is None:
        report["program_mb"] = round(sum(p.stat().st_size for p in args.out.glob("*.pt[ed]")) / 1e6, 1)
        runtime = subprocess.run([sys.executable, "-m", "benchmarks.executorch_gemma4", "--measure", str(pte)],
                                 check=True, capture_output=True, text=True)
        report["runtime"] = json.loads(runtime.stdout.strip().splitlines()[-1])
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
