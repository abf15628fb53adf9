"""ExecuTorch's own Gemma 4 export (``examples/models/gemma4/export_gemma4.py``) on the shape ours exports in
``benchmarks.audio_language gemma4-e2b``: the peer's export time, peak RSS, program size and runtime numbers.

    python -m benchmarks.executorch_gemma4 --out /work/bench/gemma4-e2b-executorch --max-seq-len 800 \
        --ours /work/bench/gemma4-e2b/ours     # benchmarks.audio_language gemma4-e2b's run

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


def export_audio_child(checkpoint: str, output: str) -> None:
    """In the child process: ExecuTorch's exporter's own steps for ``speech_transform`` and ``audio_encoder`` alone
    (its functions, partitioners and lowering settings, as ``export_single_pte`` runs them), for the audio tower's
    numbers where the whole export does not fit."""
    from executorch.examples.models.gemma4 import export_gemma4 as peer
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.exir.capture._config import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    programs = {"speech_transform": peer._export_speech_transform(checkpoint),
                "audio_encoder": peer._export_audio_encoder(checkpoint, "8da8w", group_size=32)}
    programs = {name: program.run_decompositions({}) for name, program in programs.items()}
    partitioners = peer._build_partitioners(True, False, "8da8w", "none", "8da4w")
    partitioners.pop("text_decoder")
    edge = to_edge_transform_and_lower(programs, compile_config=EdgeCompileConfig(_check_ir_validity=False),
                                       partitioner=partitioners)
    program = edge.to_executorch(ExecutorchBackendConfig(
        extract_delegate_segments=True, memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
        sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass()))
    with open(output, "wb") as f:
        program.write_to_file(f)


def measure(pte: Path, steps: int = 32, repeats: int = 3) -> dict[str, Any]:
    """RSS after load, ``audio_encoder`` on 30 s of frames (its input: [1, 2999, 128] and a mask; its partitions),
    and decode tok/s where the program has ``text_decoder``."""
    from exporters.program.contents import delegate_calls
    from exporters.runtime.memory import current_rss_mb
    from exporters.runtime.programs import LoadedProgram

    before = current_rss_mb()
    loaded = LoadedProgram(pte)
    decodes = "text_decoder" in loaded.method_names
    loaded.load("audio_encoder", *(["text_decoder"] if decodes else []))
    after_load = current_rss_mb()
    frames, mask = torch.randn(1, 2999, 128), torch.ones(1, 2999, dtype=torch.bool)
    encode_s = median_seconds(lambda: loaded.run("audio_encoder", frames, mask), repeats)
    report: dict[str, Any] = {"rss_after_load_mb": round(after_load - before, 1),
                              "audio_encode_ms_30s": round(encode_s * 1e3, 1),
                              "audio_positions": int(loaded.run("audio_encoder", frames, mask)[0].shape[1]),
                              "audio_partitions": delegate_calls(pte, "audio_encoder")}
    if decodes:
        def decode() -> None:
            for i in range(steps):
                loaded.run("text_decoder", torch.tensor([[7 + i]]), torch.tensor([16 + i]), torch.zeros(1, 1, 1536))

        report["decode_tok_s"] = round(steps / median_seconds(decode, repeats), 1)
    return report


def _measured(pte: Path) -> dict[str, Any]:
    runtime = subprocess.run([sys.executable, "-m", "benchmarks.executorch_gemma4", "--measure", str(pte)],
                             check=True, capture_output=True, text=True)
    return json.loads(runtime.stdout.strip().splitlines()[-1])


def _ours(run: Path) -> dict[str, Any]:
    """Our run's audio path measured now (``benchmarks.audio_language --measure``), its audio_encoder's partitions
    and program size from its manifest."""
    manifest = json.loads((run / "manifest.json").read_text())
    runtime = subprocess.run([sys.executable, "-m", "benchmarks.audio_language", "--measure", str(run)],
                             check=True, capture_output=True, text=True)
    return {"run": str(run), "program_mb": round(manifest["program"]["size_bytes"] / 1e6, 1),
            "audio_partitions": manifest["methods"]["audio_encoder"]["delegated_partitions"],
            "runtime": json.loads(runtime.stdout.strip().splitlines()[-1])}


def export_peer(args: argparse.Namespace) -> dict[str, Any]:
    """The peer's whole export, measured; where it fails, its audio tower alone."""
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
        report["runtime"] = _measured(pte)
    else:  # the audio tower alone, by the exporter's own steps
        audio = args.out / "audio.pte"
        cmd = [sys.executable, "-m", "benchmarks.executorch_gemma4", "--export-audio", str(args.checkpoint), str(audio)]
        wall, peak, failed = run_measured_or_failed(cmd, args.out / "export_audio.log")
        report["audio_only"] = {"wall_s": round(wall, 1), "peak_rss_mb": round(peak), "failed": failed}
        if failed is None:
            report["audio_only"].update(program_mb=round(audio.stat().st_size / 1e6, 1), runtime=_measured(audio))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--max-seq-len", type=int, default=800)
    parser.add_argument("--export", nargs=2, metavar=("CHECKPOINT", "PTE"), help=argparse.SUPPRESS)
    parser.add_argument("--export-audio", nargs=2, metavar=("CHECKPOINT", "PTE"), help=argparse.SUPPRESS)
    parser.add_argument("--measure", metavar="PTE", help="only the runtime numbers of this program, as JSON")
    parser.add_argument("--ours", type=Path, metavar="RUN", help="our run of the shape (benchmarks.audio_language's "
                        "ours/), measured after the peer; with --out's report.json already there, the peer is not "
                        "exported again")
    args = parser.parse_args()
    if args.export:
        export_child(*args.export, args.max_seq_len)
        return
    if args.export_audio:
        export_audio_child(*args.export_audio)
        return
    if args.measure:
        print(json.dumps(measure(Path(args.measure))))
        return
    if args.out is None:
        parser.error("give --out")
    args.out.mkdir(parents=True, exist_ok=True)
    measured = args.out / "report.json"
    report = json.loads(measured.read_text()) if args.ours and measured.is_file() else export_peer(args)
    if args.ours:  # our program of the same shape and the peer's audio tower, one after the other
        report["ours"] = _ours(args.ours)
        audio = args.out / "audio.pte" if "audio_only" in report else args.out / "gemma4.pte"
        (report["audio_only"] if "audio_only" in report else report)["runtime"] = _measured(audio)
    measured.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
