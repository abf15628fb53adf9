"""Prompts with a recording for an audio-language program, as an app makes them.

``preprocessor.pte`` beside the program turns the recording's 16 kHz samples into log-mel windows (ExecuTorch's
``WhisperAudioProcessor``, what an Android or iOS app runs), or the frames of one recording of any length (Gemma 4,
Granite Speech);
the prompt's text goes around them: where it writes the audio token (``[AUDIO]``, ``<|AUDIO|>``, ``<|audio|>``),
else before the text; ``chat=true`` writes the model's user turn. Gemma 4's audio positions sit between its begin
and end tokens (``<|audio>``, ``<audio|>``), as its processor writes them; images beside the recording (Gemma 4 sees
too) go through the processor on either side of it. The prompt is then fed as ExecuTorch's MultimodalRunner feeds it
(``exporters.runtime.media``). Every mismatch is refused before any method runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from exporters.errors import UserError
from exporters.manifest import AudioEntry, Manifest
from exporters.program.audio import (AUDIO_BEGIN_ID, AUDIO_END_ID, AUDIO_METHOD, AUDIO_TOKEN_ID, AUDIO_TOKENS,
                                     FRAME_RATE, FRAME_WINDOW, FRAMES_PER_SECOND, FRAMES_PER_TOKEN,
                                     GEMMA4_MAX_SAMPLES, MAX_WINDOWS, MIN_SAMPLES)
from exporters.program.speech import CHUNK_SECONDS, PREPROCESSOR_FILE, SAMPLE_RATE
from exporters.runtime.audio import Recording, read_audio
from exporters.runtime.images import check_sees_images, seen_around
from exporters.runtime.media import MediaPrompt, joined
from exporters.runtime.programs import LoadedProgram
from models.audio_language import audio_language_named, windowed_positions
from models.vision import load_processor


def audio_entry(manifest: Manifest | None) -> AudioEntry | None:
    if manifest is None:
        return None
    return next((c.audio for c in manifest.components.values() if c.audio is not None), None)


def audio_prompt(program: Any, folder: Path, prompt: str, path: str, chat: bool, encode: Callable[[str], list[int]],
                 entry: AudioEntry | None, images: Sequence[str] = ()) -> MediaPrompt:
    """``prompt`` with the recording at ``path`` (and ``images``, for a program that sees as well: Gemma 4);
    ``encode``: the program's tokenizer with its BOS."""
    if AUDIO_METHOD not in program.method_names:
        raise UserError(f"audio={path} needs a speech or audio-language program, and {program.path} has no "
                        f"{AUDIO_METHOD} method: export a Whisper or an audio-language checkpoint (Voxtral, "
                        "Qwen2-Audio, Gemma 4), or leave audio out.")
    if images:
        check_sees_images(program)
    token, frames_per_token = int(program.constant(AUDIO_TOKEN_ID)), _frames_per_token(program)
    recording = _checked_recording(program, path, frames_per_token, entry)  # not audio, or too long: refused first
    marker = _marker(entry, path)
    text = _text(prompt, chat, marker, entry, folder, path, len(images))
    if images:  # the processor writes each image's tokens on either side of the recording
        if text.count(marker) != 1:
            raise UserError(_not_marked_once(text.count(marker), token, marker))
        before, after = seen_around(program, folder, *text.split(marker), images)
    else:
        ids = encode(text)
        marks = [i for i, t in enumerate(ids) if t == token]
        if len(marks) != 1:
            raise UserError(_not_marked_once(len(marks), token, marker))
        before, after = MediaPrompt.text(ids[:marks[0]]), MediaPrompt.text(ids[marks[0] + 1:])
    return joined(before, _heard(program, token, frames_per_token, _features(folder, recording, entry)), after)


def _checked_recording(program: Any, path: str, frames_per_token: int, entry: AudioEntry | None) -> Recording:
    """The recording at ``path``, as long as one call of the program's audio encoder takes."""
    per_window, most = int(program.constant(AUDIO_TOKENS)), int(program.constant(MAX_WINDOWS))
    recording = read_audio(path)
    for conversion in recording.conversions:
        print(f"[audio: {conversion}]", file=sys.stderr)
    if frames_per_token:
        fewest = MIN_SAMPLES[entry.family if entry is not None else "gemma4"]  # a manifest older than the family's
        rate = int(program.constant(FRAME_RATE)) if FRAME_RATE in program.method_names else FRAMES_PER_SECOND
        _check_recording_length(recording.seconds, len(recording.samples), int(program.constant("get_n_frames")),
                                rate, fewest, path)
    else:
        windows = -(-len(recording.samples) // (CHUNK_SECONDS * SAMPLE_RATE))
        if windows > most:
            raise UserError(f"audio={path} is {recording.seconds:.1f} s long, {windows} windows of {CHUNK_SECONDS} s, "
                            f"and this program's {AUDIO_METHOD} takes at most {most} ({most * CHUNK_SECONDS} s) in one "
                            f"call: cut the recording, or export with a larger export.max_seq_len (each window takes "
                            f"{per_window} positions of one text_decoder call).")
    return recording


def _features(folder: Path, recording: Recording, entry: AudioEntry | None) -> torch.Tensor:
    """The recording's encoder input, from ``preprocessor.pte`` beside the program."""
    preprocessor = folder / (entry.preprocessor if entry and entry.preprocessor else PREPROCESSOR_FILE)
    if not preprocessor.is_file():
        raise UserError(f"{folder}: {preprocessor.name} is missing beside the program: it came with the export and "
                        "turns a recording into audio_encoder's input. Copy the whole run folder.")
    return LoadedProgram(preprocessor).run("forward", torch.from_numpy(recording.samples))[0].contiguous()


def _frames_per_token(program: Any) -> int:
    """A recording of any length (Gemma 4, Granite Speech): its frames a position; 0: whole 30 s windows."""
    return int(program.constant(FRAMES_PER_TOKEN)) if FRAMES_PER_TOKEN in program.method_names else 0


def _heard(program: Any, token: int, frames_per_token: int, features: torch.Tensor) -> MediaPrompt:
    """The recording's positions; Gemma 4's between its ``<|audio>`` and ``<audio|>`` as its processor writes them,
    Granite Speech's per window of frames ([1, frames, bins]) with no token around them."""
    if not frames_per_token:
        positions = int(program.constant(AUDIO_TOKENS)) * features.shape[0]
        return MediaPrompt([token] * positions, [features], (AUDIO_METHOD,))
    if FRAME_WINDOW in program.method_names:
        positions = windowed_positions(features.shape[1], int(program.constant(FRAME_WINDOW)), frames_per_token)
        return MediaPrompt([token] * positions, [features], (AUDIO_METHOD,))
    begin, end = int(program.constant(AUDIO_BEGIN_ID)), int(program.constant(AUDIO_END_ID))
    positions = features.shape[-1] // frames_per_token
    return MediaPrompt([begin, *[token] * positions, end], [torch.tensor([[begin]]), features, torch.tensor([[end]])],
                       (AUDIO_METHOD,))


def _not_marked_once(marks: int, token: int, marker: str) -> str:
    return (f"the prompt marks the audio {marks} times with token {token} ({marker!r}): write it once where the "
            "recording goes, or not at all (the recording then comes before the text); nothing was generated.")


def _check_recording_length(seconds: float, samples: int, most_frames: int, rate: int, fewest: int,
                            path: str) -> None:
    """A recording of any length (Gemma 4, Granite Speech) fits the preprocessor (``fewest`` samples to 30 s) and one
    call of audio_encoder (``most_frames`` frames, ``rate`` a second: as many as one text_decoder call takes)."""
    longest = min(GEMMA4_MAX_SAMPLES / SAMPLE_RATE, most_frames / rate)
    if samples < fewest or seconds > longest:
        raise UserError(f"audio={path} is {seconds:.2f} s long, and this program takes one recording of "
                        f"{fewest / SAMPLE_RATE:.2f} s to {longest:.2f} s ({most_frames} frames of {1000 // rate} ms, "
                        "as many as one text_decoder call takes; at most 30 s): cut the recording"
                        + (", or export with a larger export.max_seq_len." if longest < 30 else "."))


def _marker(entry: AudioEntry | None, path: str) -> str:
    """The audio token's text, as the manifest records it."""
    if entry is None or not entry.audio_token:
        raise UserError(f"audio={path}: the manifest beside the program names no audio token text (its tokenizer is "
                        "not a tokenizer.json): export again with the checkpoint's tokenizer.json.")
    return entry.audio_token


def _text(prompt: str, chat: bool, marker: str, entry: AudioEntry | None, folder: Path, path: str,
          images: int = 0) -> str:
    """The prompt's text with the audio token where the recording goes (``images``: the chat's pictures, before it)."""
    if not chat:
        return prompt if marker in prompt else marker + prompt
    family = audio_language_named(entry.family) if entry is not None else None
    if family is not None and family.chat is not None and not images:
        return family.chat.format(audio=marker, prompt=prompt)
    processor = load_processor(folder)
    if not getattr(processor, "chat_template", None):
        raise UserError(f"chat=true needs the processor's chat template, and {folder} has none: use chat=false and "
                        f"write {marker!r} where the recording goes (or leave it out: it then comes first).")
    content = [*[{"type": "image"}] * images, {"type": "audio", "path": path}, {"type": "text", "text": prompt}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
