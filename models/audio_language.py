"""Audio-language checkpoints: which ones we read, where their audio encoder's tensors are, and its geometry.

An audio-language checkpoint (Voxtral, Qwen2-Audio) holds a text decoder of a family we already implement
(``models.families``) beside an audio tower (Whisper's encoder) and a projector. Its text decoder is read as a
vision-language checkpoint's is (``models.multimodal``); the tower and projector by ``models.audio_encoder``.
The geometry comes from ``config.json`` alone: log-mel windows of ``bins x frames`` (30 s at Whisper's 100 frames
a second), each giving ``tokens`` embeddings to the text decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from models.errors import ModelError


@dataclass(frozen=True)
class AudioGeometry:
    """What a program's ``audio_encoder`` takes and gives: ``[windows, bins, frames]`` log-mel features of 30 s
    windows in, ``[1, windows * tokens, hidden]`` out."""

    family: str
    bins: int  # log-mel bins (Whisper's feature extractor with feature_size=bins)
    frames: int  # frames per window
    tokens: int  # embeddings per window
    audio_token_id: int  # the token each embedding position takes in a prompt
    max_windows: int  # the most windows one call takes (AudioLanguage.max_windows)


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

    def geometry(self, hf_config: Any) -> AudioGeometry:
        audio = hf_config.audio_config
        token = getattr(hf_config, "audio_token_id", None)
        if token is None:
            token = getattr(hf_config, "audio_token_index", None)
        if token is None:
            raise ModelError(f"config.json of {hf_config.architectures[0]} names no audio_token_id: the checkpoint is "
                             "incomplete or its config was edited. Use the config.json it was saved with.")
        return AudioGeometry(self.name, int(audio.num_mel_bins), 2 * int(audio.max_source_positions),
                             self.tokens(hf_config), int(token), self.max_windows)


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


_TOWER_AND_PROJECTOR = ("audio_tower.", "multi_modal_projector.", "model.audio_tower.", "model.multi_modal_projector.")
AUDIO_LANGUAGE: tuple[AudioLanguage, ...] = (
    # Voxtral's tekken tokenizer (mistral_common) writes its turn so; ExecuTorch's voxtral runner the same.
    AudioLanguage("voxtral", ("VoxtralForConditionalGeneration",), _TOWER_AND_PROJECTOR, _voxtral_tokens, 10,
                  "[INST][BEGIN_AUDIO]{audio}{prompt}[/INST]"),
    AudioLanguage("qwen2_audio", ("Qwen2AudioForConditionalGeneration",), _TOWER_AND_PROJECTOR, _qwen2_audio_tokens, 1),
)


def audio_language_of(hf_config: Any) -> AudioLanguage | None:
    """The audio-language architecture of ``config.json``, or None."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    return next((a for a in AUDIO_LANGUAGE for arch in archs if arch in a.architectures), None)


def is_audio_language(architectures: list[str]) -> bool:
    """Whether ``config.json``'s ``architectures`` name an audio-language model (without building its config)."""
    return any(arch in a.architectures for a in AUDIO_LANGUAGE for arch in architectures)


def audio_language_named(name: str) -> AudioLanguage:
    return next(a for a in AUDIO_LANGUAGE if a.name == name)
