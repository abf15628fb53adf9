"""A published audio-language shape with seeded random weights, exported and run: what a real size costs.

    python -m benchmarks.audio_language voxtral-mini-3b --out /work/bench/voxtral
    python -m benchmarks.audio_language gemma4-e2b --out /work/bench/gemma4-e2b --max-seq-len 800
    python -m benchmarks.audio_language granite-speech-2b --out /work/bench/granite-speech-2b
    python -m benchmarks.audio_language --measure <run folder>      # the runtime numbers of one program

No audio-language weights ship in a package we found; the shape is the published ``config.json``'s (transformers'
own config class), exported with ``model.random_init=true``. The export runs in a child process (its wall time and
peak RSS from ``os.wait4``, beside the manifest's estimate and stage times); then, on the loaded program, RSS after
load, ``audio_encoder`` on one 30 s window of the validation recording (its features from the run's
``preprocessor.pte``; Gemma 4, Granite Speech: the recording repeated to the longest the program takes, 30 s at most),
a prompt with
that audio (text, the audio, text: the MultimodalRunner's calls) in tokens per second, and decode. Medians after a
warm-up. Writes ``report.json`` into ``--out`` (docs/audio.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from benchmarks.exporting import exporter_command, run_measured_or_failed
from benchmarks.vision import median_seconds
from benchmarks.vision_shapes import gemma4_e2b as gemma4_e2b_with_images
from exporters.program.audio import (AUDIO_METHOD, FRAME_RATE, FRAMES_PER_SECOND, FRAMES_PER_TOKEN,
                                     GEMMA4_MAX_SAMPLES)
from exporters.program.speech import PREPROCESSOR_FILE, SAMPLE_RATE
from exporters.runtime.audio import read_audio
from exporters.runtime.driver import Driver, MethodRoles, program_method_shapes
from exporters.runtime.generator import resolve_program
from exporters.runtime.media import MediaPrompt, prefill_parts
from exporters.runtime.memory import current_rss_mb
from exporters.runtime.programs import LoadedProgram
from exporters.validation.speech import VALIDATION_RECORDING


def voxtral_mini_3b() -> Any:
    """Voxtral Mini 3B (mistralai/Voxtral-Mini-3B-2507): Whisper large-v3's encoder (1280 wide x 32 layers, 128 mel
    bins), 4 states stacked into a two-layer projector, a Llama decoder 3072 wide x 30 layers with 131k tokens
    (transformers' VoxtralConfig defaults are this checkpoint's)."""
    from transformers import VoxtralConfig

    return VoxtralConfig(audio_token_id=24, architectures=["VoxtralForConditionalGeneration"])


def gemma4_e2b() -> Any:
    """Gemma 4 E2B's decoder (``benchmarks.vision_shapes.gemma4_e2b``) with transformers' default Gemma 4 audio tower
    (``Gemma4AudioConfig``: a conformer 1024 wide x 12 layers, 305M parameters with ``embed_audio``) and no image
    tower: the audio path alone."""
    from transformers import Gemma4AudioConfig

    config = gemma4_e2b_with_images()
    config.vision_config, config.audio_config = None, Gemma4AudioConfig()
    return config


def granite_speech_2b() -> Any:
    """Granite Speech 3.3 2B (ibm-granite/granite-speech-3.3-2b) as its model card describes it, not checkable
    offline: a conformer 1024 wide x 16 layers in 200-frame blocks (its CTC head over 348 characters), a Q-Former of 2
    layers 1024 wide, and Granite 3.3 2B's decoder (2048 wide x 40 layers, 49,160 tokens, its four multipliers).
    Without its LoRA adapter (not built: docs/audio.md)."""
    from transformers import Blip2QFormerConfig, GraniteConfig, GraniteSpeechConfig, GraniteSpeechEncoderConfig

    text = GraniteConfig(vocab_size=49160, hidden_size=2048, intermediate_size=8192, num_hidden_layers=40,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0},
                         embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
                         logits_scaling=8.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    encoder = GraniteSpeechEncoderConfig(num_layers=16, hidden_dim=1024, num_heads=8, dim_head=128, output_dim=348)
    projector = Blip2QFormerConfig(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, intermediate_size=4096,
                                   encoder_hidden_size=1024, cross_attention_frequency=1, max_position_embeddings=2048,
                                   layer_norm_eps=1e-12)
    return GraniteSpeechConfig(text_config=text, encoder_config=encoder, projector_config=projector,
                               audio_token_index=49159, has_lora_adapter=False,
                               architectures=["GraniteSpeechForConditionalGeneration"])


SHAPES: dict[str, Callable[[], Any]] = {"voxtral-mini-3b": voxtral_mini_3b, "gemma4-e2b": gemma4_e2b,
                                        "granite-speech-2b": granite_speech_2b}
# Our export of each: Gemma 4's embedding tables (its per-layer one is 2.35B parameters) at 4 bits as well.
# Gemma 4 E2B without validation: its validate stage alone took 426 s and the export's peak 21.7 GB of this machine's
# 24 (docs/vision.md), and the audio tower adds its weights to it.
OURS = {"voxtral-mini-3b": ["quant=8da4w", "quant.group_size=32"],
        "gemma4-e2b": ["quant=8da4w_emb4w", "validate=false"], "granite-speech-2b": ["quant=8da4w"]}


def measure(program: str, text_tokens: int = 16, steps: int = 32, repeats: int = 3) -> dict[str, float | str]:
    pte = resolve_program(program)
    before = current_rss_mb()
    loaded = LoadedProgram(pte)
    mm = MethodRoles.through_embeddings(program_method_shapes(loaded))
    driver = Driver.of(loaded)
    loaded.load(AUDIO_METHOD, *(m for m in (mm.prompt, mm.embed, driver.roles.step) if m))
    after_load = current_rss_mb()
    samples = read_audio(VALIDATION_RECORDING).samples
    if FRAMES_PER_TOKEN in loaded.method_names:  # one recording of any length: the longest the program takes
        rate = int(loaded.constant(FRAME_RATE)) if FRAME_RATE in loaded.method_names else FRAMES_PER_SECOND
        frames = int(loaded.constant("get_n_frames"))
        samples = np.resize(samples, min(GEMMA4_MAX_SAMPLES, frames * SAMPLE_RATE // rate))
    features = LoadedProgram(pte.parent / PREPROCESSOR_FILE).run("forward", torch.from_numpy(samples))[0][:1]
    features = features.contiguous()
    positions = loaded.run(AUDIO_METHOD, features)[0].shape[1]
    vocab = int(loaded.constant("get_vocab_size"))
    text = torch.arange(3, 3 + 2 * text_tokens).remainder(vocab).reshape(1, -1)
    prompt = MediaPrompt.of([], [text[:, :text_tokens], features, text[:, text_tokens:]], AUDIO_METHOD)
    prompt_len = 2 * text_tokens + positions
    steps = min(steps, int(loaded.constant("get_max_context_len")) - prompt_len)
    encode_s = median_seconds(lambda: loaded.run(AUDIO_METHOD, features), repeats)
    prompt_s = median_seconds(lambda: prefill_parts(loaded, mm, prompt), repeats)

    def decode() -> None:
        for i in range(steps):
            driver.decode_one_token(7 + i % 100, prompt_len + i)

    decode_s = median_seconds(decode, repeats)
    return {"rss_after_load_mb": round(after_load - before, 1), "audio_encode_ms_30s": round(encode_s * 1e3, 1),
            "audio_seconds": round(min(len(samples) / SAMPLE_RATE, 30.0), 2), "audio_positions": positions, "prompt_tokens": prompt_len,
            "prompt_with_audio_tok_s": round(prompt_len / prompt_s, 1), "decode_tok_s": round(steps / decode_s, 1),
            "decode_method": driver.roles.step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, help="the benchmark's folder (the shape, the run, report.json)")
    parser.add_argument("--max-seq-len", type=int, default=400, help="one call: a 30 s window's 375 positions and text")
    parser.add_argument("--measure", metavar="RUN", help="only the runtime numbers of this run folder, as JSON")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    if args.shape is None or args.out is None:
        parser.error("give a shape and --out (or --measure RUN)")
    args.out.mkdir(parents=True, exist_ok=True)
    shape = args.out / "shape"
    SHAPES[args.shape]().save_pretrained(shape)
    run = args.out / "ours"
    overrides = ["model=hf", f"model.checkpoint={shape}", "model.random_init=true", *OURS[args.shape],
                 f"export.max_seq_len={args.max_seq_len}", f"export.max_context_len={args.max_seq_len + 64}"]
    wall, peak, failed = run_measured_or_failed(exporter_command(overrides, run), args.out / "ours.log")
    report: dict[str, Any] = {"shape": args.shape, "overrides": overrides, "wall_s": round(wall, 1),
                              "peak_rss_mb": round(peak), "failed": failed}
    if failed is None:
        manifest = json.loads((run / "manifest.json").read_text())
        resources = manifest["resources"]
        report.update(program_mb=round(manifest["program"]["size_bytes"] / 1e6, 1),
                      estimated_peak_rss_mb=resources.get("estimated_peak_rss_mb"),
                      stages_s={k: round(v, 1) for k, v in manifest["timings_s"].items()})
        runtime = subprocess.run([sys.executable, "-m", "benchmarks.audio_language", "--measure", str(run)],
                                 check=True, capture_output=True, text=True)
        report["runtime"] = json.loads(runtime.stdout.strip().splitlines()[-1])
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
