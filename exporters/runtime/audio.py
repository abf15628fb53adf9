"""Speech into a transcript: audio files read and converted, log-mel windows, and greedy decoding over any runner
of the two methods (the program in the ExecuTorch runtime, or the eager model).

Files are read by libsndfile (``soundfile``: WAV, FLAC, OGG/Vorbis, MP3 and more), mixed to mono and resampled to
16 kHz by ``soxr`` where they are not already; each conversion is said. A recording longer than 30 s is cut into
consecutive 30 s windows, each transcribed on its own (Whisper's sequential long-form without timestamps).
Decoding is transformers' for Whisper without timestamps: the prompt (start, language, task, no timestamps), then
greedy with the checkpoint's suppressed tokens removed (``suppress_tokens``, and ``begin_suppress_tokens`` at the
first generated token), so the fp32 program's transcript is transformers' token for token (tests/test_speech.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from exporters.errors import UserError
from exporters.program.speech import CHUNK_SECONDS, SAMPLE_RATE, SpeechTokens

log = logging.getLogger("exporters")

#: Below this peak (in [-1, 1] samples) a recording is silence: nothing to transcribe.
SILENCE_PEAK = 1e-4

RunEncoder = Callable[[torch.Tensor], torch.Tensor]
RunDecoder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Recording:
    """16 kHz mono float samples, and what was done to the file to get them."""

    samples: np.ndarray
    source: str
    conversions: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE


def read_audio(path: str | Path) -> Recording:
    """The file at ``path`` as 16 kHz mono float samples; a UserError for anything that is not usable audio."""
    import soundfile

    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"audio={path}: no such file. Give a WAV, FLAC, OGG or MP3 recording.")
    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
        raise UserError(f"audio={path}: cannot be read as audio ({e}). Give a WAV, FLAC, OGG or MP3 recording "
                        "(PCM, float or a compressed format libsndfile decodes).") from None
    conversions = []
    if data.shape[1] > 1:
        conversions.append(f"{data.shape[1]} channels mixed to mono")
        data = data.mean(axis=1, keepdims=True)
    samples = np.ascontiguousarray(data[:, 0])
    if rate != SAMPLE_RATE:
        import soxr

        conversions.append(f"resampled from {rate} Hz to {SAMPLE_RATE} Hz")
        samples = soxr.resample(samples, rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    if samples.size == 0:
        raise UserError(f"audio={path}: holds no samples. Give a recording with speech in it.")
    if float(np.abs(samples).max()) < SILENCE_PEAK:
        raise UserError(f"audio={path}: is silent ({len(samples) / SAMPLE_RATE:.1f} s, peak below {SILENCE_PEAK:g}): "
                        "nothing to transcribe. Check the recording's input level.")
    return Recording(samples, str(path), conversions)


def windows(recording: Recording) -> list[np.ndarray]:
    """Consecutive 30 s windows of the samples (the last one shorter)."""
    step = CHUNK_SECONDS * SAMPLE_RATE
    return [recording.samples[i:i + step] for i in range(0, len(recording.samples), step)]


def features(samples: np.ndarray, extractor: object) -> torch.Tensor:
    """One window's log-mel features ``[1, mels, 3000]`` by transformers' ``WhisperFeatureExtractor``."""
    return extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features  # type: ignore[operator]


@dataclass(frozen=True)
class Transcript:
    tokens: list[int]  # generated, the end token excluded
    prompt: list[int]
    encode_s: float = 0.0
    decode_s: float = 0.0


def _suppressed(logits: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    if ids:
        logits = logits.clone()
        logits[list(ids)] = float("-inf")
    return logits


def detect_language(decoder: RunDecoder, states: torch.Tensor, tokens: SpeechTokens) -> int:
    """The language token the decoder ranks first after the start token (transformers' ``detect_language``)."""
    logits = decoder(torch.tensor([[tokens.start]]), states, torch.tensor([0]))[0, -1]
    ids = list(tokens.languages.values())
    return ids[int(logits[ids].argmax())]


def greedy(decoder: RunDecoder, states: torch.Tensor, prompt: list[int], tokens: SpeechTokens,
           max_new: int) -> list[int]:
    """Greedy tokens after ``prompt`` until the end token or ``max_new`` (the end token not included)."""
    logits = decoder(torch.tensor([prompt]), states, torch.arange(len(prompt)))[0, -1]
    out: list[int] = []
    position = len(prompt)
    while len(out) < max_new:
        step = _suppressed(logits, tokens.suppress if out else (*tokens.suppress, *tokens.suppress_at_begin))
        token = int(step.argmax())
        if token == tokens.end:
            break
        out.append(token)
        if len(out) == max_new:
            break
        logits = decoder(torch.tensor([[token]]), states, torch.tensor([position]))[0, -1]
        position += 1
    return out
