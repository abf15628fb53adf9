"""A speech-recognition program: its methods as ExecuTorch's ``AsrRunner`` calls them, its constants, its
preprocessor.

The runner (``extension/asr/runner/seq2seq_runner.cpp``, 1.5) calls ``encoder`` once per 30 s window of log-mel
features and ``text_decoder(token [1, 1], encoder states, cache_position [1])`` per token, from
``decoder_start_token_id`` until an id of ``get_eos_ids``; ``examples/models/whisper/main.cpp`` first runs a
``preprocessor.pte`` (ExecuTorch's ``WhisperAudioProcessor``: 16 kHz mono float samples in, ``[1, mels, 3000]`` per
30 s out). The kind itself (planning, building, quantizing, validating it) is ``exporters.components.speech``; the
model is ``models.whisper``.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from filelock import FileLock

from exporters.config import ModelConfig, Source
from exporters.manifest import Signature, TensorSpec
from exporters.output.files import private_path
from exporters.program.versions import installed
from models.gguf import llm_exporters_cache
from models.whisper import ENCODER, TEXT_DECODER, WhisperShape, is_whisper

log = logging.getLogger("exporters")

SAMPLE_RATE = 16_000  # Whisper's: every recording is converted to it
CHUNK_SECONDS = 30  # one encoder call: 30 s of audio, 3000 frames of 10 ms
PREPROCESSOR_FILE = "preprocessor.pte"
#: The longest recording the preprocessor takes in one call (ExecuTorch's example exports 300 s).
PREPROCESSOR_MAX_SECONDS = 300
METHODS = (ENCODER, TEXT_DECODER)


@dataclass(frozen=True)
class SpeechTokens:
    """The special tokens a transcript's prompt is made of, from the checkpoint's generation config and tokenizer."""

    start: int  # <|startoftranscript|>: decoder_start_token_id
    end: int  # <|endoftext|>
    transcribe: int | None  # None: an English-only checkpoint has no task tokens
    translate: int | None
    no_timestamps: int | None
    languages: dict[str, int]  # "en" -> <|en|>'s id (empty: English-only)
    suppress: tuple[int, ...]  # never generated
    suppress_at_begin: tuple[int, ...]  # not as the first generated token

    @staticmethod
    def of(generation: Any) -> "SpeechTokens":
        """From transformers' ``GenerationConfig`` of a Whisper checkpoint."""
        languages = {code.strip("<|>"): int(i) for code, i in (getattr(generation, "lang_to_id", None) or {}).items()}
        tasks = getattr(generation, "task_to_id", None) or {}
        eos = generation.eos_token_id
        return SpeechTokens(
            start=int(generation.decoder_start_token_id), end=int(eos[0] if isinstance(eos, list) else eos),
            transcribe=tasks.get("transcribe"), translate=tasks.get("translate"),
            no_timestamps=getattr(generation, "no_timestamps_token_id", None), languages=languages,
            suppress=tuple(generation.suppress_tokens or ()), suppress_at_begin=tuple(generation.begin_suppress_tokens or ()))

    def prompt(self, language: int | None, task: str) -> list[int]:
        """The decoder's first tokens: start, language, task, no timestamps (those the checkpoint has)."""
        task_token = self.translate if task == "translate" else self.transcribe
        return [self.start, *([language] if language is not None else []),
                *([task_token] if task_token is not None else []),
                *([self.no_timestamps] if self.no_timestamps is not None else [])]


def is_speech(model: ModelConfig) -> bool:
    """Whether ``model.checkpoint`` is a speech recognizer (a Whisper folder, Hugging Face's or faster-whisper's)."""
    return model.source == Source.hf and model.checkpoint is not None and is_whisper(Path(model.checkpoint).expanduser())


def speech_constants(shape: WhisperShape, tokens: SpeechTokens, max_tokens: int) -> dict[str, Any]:
    """The runner's constant (``get_eos_ids``) and what an app needs to make the methods' inputs and prompt."""
    values: dict[str, Any] = {
        "get_eos_ids": [tokens.end],
        "decoder_start_token_id": tokens.start,
        "get_max_seq_len": max_tokens,
        "get_vocab_size": shape.vocab,
        "get_sample_rate": SAMPLE_RATE,
        "get_num_mel_bins": shape.mel_bins,
        "get_chunk_length": CHUNK_SECONDS,
        "get_n_frames": shape.frames,
    }
    for name, token in (("transcribe", tokens.transcribe), ("translate", tokens.translate),
                        ("no_timestamps", tokens.no_timestamps)):
        if token is not None:
            values[f"get_{name}_token_id"] = token
    if tokens.languages:
        values["get_english_token_id"] = tokens.languages.get("en", -1)
    return values


def speech_signatures(shape: WhisperShape, max_tokens: int) -> dict[str, Signature]:
    """The two methods' inputs and outputs, as the manifest records them."""
    width = shape.heads * shape.head_dim
    states = TensorSpec("encoder_states", [1, shape.audio_positions, width], "float32")
    return {
        ENCODER: Signature(inputs=[TensorSpec("features", [1, shape.mel_bins, shape.frames], "float32")],
                           outputs=[states]),
        TEXT_DECODER: Signature(
            inputs=[TensorSpec("tokens", [1, "num_tokens"], "int64"), states,
                    TensorSpec("cache_position", ["num_tokens"], "int64")],
            outputs=[TensorSpec("logits", [1, "num_tokens", shape.vocab], "float32")]),
    }


def write_preprocessor(path: Path, mel_bins: int, max_seconds: int = PREPROCESSOR_MAX_SECONDS) -> None:
    """ExecuTorch's ``WhisperAudioProcessor`` (its own log-mel, equal to transformers' feature extractor) lowered
    to XNNPACK and written to ``path``: samples ``[N]`` (16 kHz mono float, up to ``max_seconds``) in, features
    ``[n_windows, mels, 3000]`` out, one 30 s window per row."""
    def make(out: Path) -> None:
        from executorch.extension.audio.mel_spectrogram import export_processor

        export_processor(str(out), backend="xnnpack", feature_size=mel_bins, max_audio_len=max_seconds,
                         stack_output=True)

    copy_cached_program(path, f"whisper-mel{mel_bins}-{max_seconds}s", make)


def copy_cached_program(path: Path, name: str, make: Callable[[Path], None]) -> None:
    """The program ``make`` writes, copied to ``path``. A preprocessor depends on nothing but its ``name``'s
    parameters and the installed packages, and lowering it takes seconds, so it is made once per (those, the
    versions) in the project's cache and copied from there."""
    versions = "-".join(f"{package}{installed(package)}" for package in ("executorch", "torch"))
    cached = llm_exporters_cache() / "preprocessors" / f"{name}-{versions}.pte"
    cached.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cached) + ".lock"):
        if not cached.is_file():
            made = private_path(cached, "made")
            make(made)
            made.replace(cached)
    shutil.copyfile(cached, path)


def preprocessor_features(samples: torch.Tensor, mel_bins: int) -> torch.Tensor:
    """What the preprocessor computes, in PyTorch: ``[n_windows, mels, 3000]``."""
    from executorch.extension.audio.mel_spectrogram import WhisperAudioProcessor

    with torch.no_grad():
        return WhisperAudioProcessor(feature_size=mel_bins, stack_output=True)(samples)
