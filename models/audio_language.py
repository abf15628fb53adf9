"""Audio-language checkpoints: which ones we read, where their audio encoder's tensors are, and its geometry.

An audio-language checkpoint (Voxtral, Qwen2-Audio, Gemma 4, Granite Speech) holds a text decoder of a family we already implement
(``models.families``) beside an audio tower and a projector. Its text decoder is read as a vision-language
checkpoint's is (``models.multimodal``); the tower and projector by ``models.audio_encoder``. The geometry comes
from ``config.json`` alone. Two kinds: Whisper's encoder (Voxtral, Qwen2-Audio) takes log-mel windows of ``bins x
frames`` (30 s at 100 frames a second), each giving ``tokens`` embeddings to the text decoder; Gemma 4's conformer
takes one recording of any length up to 30 s, ``frames_per_token`` frames a position, between a begin and an end
token; Granite Speech's conformer one recording of any length too, in time-major frames of two stacked log-mel frames
(50 a second), each window of 15 giving 3 positions (the last window partial).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from models.errors import ModelError


def windowed_positions(frames: int, window: int, frames_per_token: int) -> int:
    """The positions ``frames`` frames give where every window of ``window`` frames, the last one partial, gives
    ``window // frames_per_token`` of them (Granite Speech's projector)."""
    return -(-frames // window) * (window // frames_per_token)


@dataclass(frozen=True)
class AudioGeometry:
    """What a program's ``audio_encoder`` takes and gives: ``[windows, bins, frames]`` log-mel features of 30 s
    windows in, ``[1, windows * tokens, hidden]`` out; or, where ``frames_per_token`` is set (Gemma 4), one
    recording's ``[1, bins, frames_per_token * m]`` frames in, its ``m`` positions out (at most ``tokens``)."""

    family: str
    bins: int  # log-mel bins (Whisper's feature extractor with feature_size=bins)
    frames: int  # frames per window (Gemma 4: the most one recording has, 30 s)
    tokens: int  # embeddings per window (Gemma 4: the most one recording gives)
    audio_token_id: int  # the token each embedding position takes in a prompt
    max_windows: int  # the most windows one call takes (AudioLanguage.max_windows)
    frames_per_token: int = 0  # Gemma 4: log-mel frames per position of a recording of any length; 0: whole windows
    begin_token_id: int | None = None  # written before the audio's positions (Gemma 4's <|audio>)
    end_token_id: int | None = None  # and after them (<audio|>)
    # Granite Speech: positions come per window of this many frames (frame_window / frames_per_token each), the last
    # window partial, so the frame count is any number; 0: frames in whole positions (Gemma 4)
    frame_window: int = 0
    frames_per_second: int = 100  # Granite Speech's stacked frames: 50
    time_major: bool = False  # the frames as [1, frames, bins] (Granite Speech), else [1, bins, frames]

    @property
    def any_length(self) -> bool:
        """One recording of any length a call (Gemma 4, Granite Speech), not whole 30 s windows."""
        return self.frames_per_token > 0

    def positions(self, frames: int) -> int:
        """The positions ``frames`` frames of a recording of any length give."""
        if self.frame_window:
            return windowed_positions(frames, self.frame_window, self.frames_per_token)
        return frames // self.frames_per_token

    def frames_for(self, positions: int) -> int:
        """The most frames whose positions fit in ``positions``."""
        if self.frame_window:
            return positions // (self.frame_window // self.frames_per_token) * self.frame_window
        return positions * self.frames_per_token


@dataclass(frozen=True)
class AudioLanguage:
    """One audio-language architecture: its text decoder is a family of ``models.families``."""

    name: str
    architectures: tuple[str, ...]
    # Prefixes of the tensors that are not the text decoder's (the audio tower and the projector), every layout.
    audio_prefixes: tuple[str, ...]
    # config -> embeddings per window
    tokens: Callable[[Any], int]
    # The longest recording one call of audio_encoder takes, in windows (Voxtral's several 30 s windows in one call,
    # as optimum-executorch exports it; Qwen2-Audio's processor cuts every recording to one window).
    max_windows: int
    # A user turn with a recording, where the checkpoint ships no chat template transformers reads ({audio}: the
    # audio token, {prompt}: the text); None: the processor's chat template.
    chat: str | None = None
    # The geometry of a tower that is not Whisper's encoder (Gemma 4's); None: Whisper's windows.
    any_length: Callable[[Any, int], AudioGeometry] | None = None
    # The config field of the audio tower's config: a checkpoint without it has no tower (Gemma 4 31B).
    tower_config: str = "audio_config"
    # The decoder's LoRA adapter a checkpoint folder carries for prompts with audio (config, folder -> the folder
    # holding adapter_config.json, or None), as transformers loads and enables it (Granite Speech's).
    audio_adapter: Callable[[Any, Path], Path | None] | None = None
    # The decoder's module paths in the adapter's keys (transformers 5's, then 4's layout), for ``model.``: ours.
    adapter_prefixes: tuple[str, ...] = ()

    def geometry(self, hf_config: Any) -> AudioGeometry:
        token = _id(hf_config, "audio_token_id", "audio_token_index")
        if self.any_length is not None:
            return self.any_length(hf_config, token)
        audio = hf_config.audio_config
        return AudioGeometry(self.name, int(audio.num_mel_bins), 2 * int(audio.max_source_positions),
                             self.tokens(hf_config), token, self.max_windows)


def _id(hf_config: Any, *names: str) -> int:
    """The token id ``config.json`` gives under the first of ``names`` it has."""
    value = next((getattr(hf_config, n) for n in names if getattr(hf_config, n, None) is not None), None)
    if value is None:
        raise ModelError(f"config.json of {hf_config.architectures[0]} names no {names[0]}: the checkpoint is "
                         "incomplete or its config was edited. Use the config.json it was saved with.")
    return int(value)


def _voxtral_tokens(cfg: Any) -> int:
    """Whisper's encoder halves the frames; the projector stacks ``intermediate_size / hidden_size`` of its states
    (4 in Voxtral Mini and Small) into one embedding."""
    audio = cfg.audio_config
    if audio.intermediate_size % audio.hidden_size:
        raise ModelError(f"audio_config.intermediate_size={audio.intermediate_size} is not a multiple of its "
                         f"hidden_size={audio.hidden_size}: Voxtral's projector stacks whole encoder states. The config "
                         "is not a Voxtral's.")
    return audio.max_source_positions // (audio.intermediate_size // audio.hidden_size)


def _qwen2_audio_tokens(cfg: Any) -> int:
    """Whisper's encoder halves the frames, then an average pool of 2."""
    return cfg.audio_config.max_source_positions // 2


# Gemma 4's audio: 128 log-mel bins (its subsampling convolutions fix them), 100 frames a second, 4 frames a
# position (two stride-2 convolutions); the feature extractor keeps 30 s (max_length 480,000 samples), the processor
# at most 750 positions (audio_seq_length).
GEMMA4_MEL_BINS, GEMMA4_FRAMES_PER_TOKEN, GEMMA4_MAX_FRAMES = 128, 4, 3000


def _gemma4_geometry(cfg: Any, token: int) -> AudioGeometry:
    """One recording of up to 30 s between ``<|audio>`` and ``<audio|>``."""
    return AudioGeometry("gemma4", GEMMA4_MEL_BINS, GEMMA4_MAX_FRAMES, GEMMA4_MAX_FRAMES // GEMMA4_FRAMES_PER_TOKEN,
                         token, 1, GEMMA4_FRAMES_PER_TOKEN, _id(cfg, "boa_token_id", "boa_token_index"),
                         _id(cfg, "eoa_token_id", "eoa_token_index"))


# Granite Speech takes recordings of any length; a program takes up to 30 s in one call, as Gemma 4's.
GRANITE_SECONDS, GRANITE_FRAMES_PER_SECOND = 30, 50


def _granite_speech_geometry(cfg: Any, token: int) -> AudioGeometry:
    """One recording of up to 30 s in encoder frames (``encoder_config.input_dim`` wide: two 80-bin frames), each
    window of ``window_size`` frames giving ``window_size // downsample_rate`` positions; no begin or end token."""
    if cfg.window_size % cfg.downsample_rate:
        raise ModelError(f"window_size={cfg.window_size} is not a multiple of downsample_rate={cfg.downsample_rate}: "
                         "Granite Speech's projector gives whole queries per window. The config is not a Granite "
                         "Speech's.")
    frames = GRANITE_SECONDS * GRANITE_FRAMES_PER_SECOND
    geometry = AudioGeometry("granite_speech", int(cfg.encoder_config.input_dim), frames, 0, token, 1,
                             cfg.downsample_rate, frame_window=cfg.window_size,
                             frames_per_second=GRANITE_FRAMES_PER_SECOND, time_major=True)
    return dataclasses.replace(geometry, tokens=geometry.positions(frames))


def _granite_speech_adapter(cfg: Any, folder: Path) -> Path | None:
    """The published checkpoints carry a LoRA adapter for the decoder (``has_lora_adapter``, ``adapter_config.json``
    in the folder), which transformers enables for a prompt with audio and disables for text alone."""
    return folder if getattr(cfg, "has_lora_adapter", False) and (folder / "adapter_config.json").is_file() else None


_TOWER_AND_PROJECTOR = ("audio_tower.", "multi_modal_projector.", "model.audio_tower.", "model.multi_modal_projector.")
AUDIO_LANGUAGE: tuple[AudioLanguage, ...] = (
    # Voxtral's tekken tokenizer (mistral_common) writes its turn so; ExecuTorch's voxtral runner the same.
    AudioLanguage("voxtral", ("VoxtralForConditionalGeneration",), _TOWER_AND_PROJECTOR, _voxtral_tokens, 10,
                  "[INST][BEGIN_AUDIO]{audio}{prompt}[/INST]"),
    AudioLanguage("qwen2_audio", ("Qwen2AudioForConditionalGeneration",), _TOWER_AND_PROJECTOR, _qwen2_audio_tokens, 1),
    # Gemma 4 (E2B, E4B) hears audio beside its images; a checkpoint without audio_config (the 31B) does not.
    AudioLanguage("gemma4", ("Gemma4ForConditionalGeneration",),
                  ("model.audio_tower.", "audio_tower.", "model.embed_audio.", "embed_audio."),
                  lambda cfg: GEMMA4_MAX_FRAMES // GEMMA4_FRAMES_PER_TOKEN, 1, any_length=_gemma4_geometry),
    # Granite Speech (3.3 2B and 8B): a conformer and a Q-Former projector beside a Granite decoder. Its chat template
    # writes Granite's role tokens (the tokenizer's own template adds a system turn of its own when none is given).
    AudioLanguage("granite_speech", ("GraniteSpeechForConditionalGeneration",),
                  ("model.encoder.", "encoder.", "model.projector.", "projector."), lambda cfg: 0, 1,
                  "<|start_of_role|>user<|end_of_role|>{audio}{prompt}<|end_of_text|>\n"
                  "<|start_of_role|>assistant<|end_of_role|>", any_length=_granite_speech_geometry,
                  tower_config="encoder_config", audio_adapter=_granite_speech_adapter,
                  adapter_prefixes=("model.language_model.", "language_model.model.")),
)


def audio_language_of(hf_config: Any) -> AudioLanguage | None:
    """The audio-language architecture of ``config.json``, or None (also for a checkpoint of such an architecture
    that has no audio tower: Gemma 4 31B)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    family = next((a for a in AUDIO_LANGUAGE for arch in archs if arch in a.architectures), None)
    return family if family is not None and getattr(hf_config, family.tower_config, None) is not None else None


def is_audio_language(architectures: list[str]) -> bool:
    """Whether ``config.json``'s ``architectures`` name an audio-language model (without building its config)."""
    return any(arch in a.architectures for a in AUDIO_LANGUAGE for arch in architectures)


def audio_language_named(name: str) -> AudioLanguage:
    return next(a for a in AUDIO_LANGUAGE if a.name == name)
