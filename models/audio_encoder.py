"""The audio encoder of an audio-language checkpoint: log-mel windows in, audio embeddings in the text decoder's width.

Built from transformers' own modules (the audio tower and the projector of the checkpoint's architecture), so it
computes what transformers computes; each family's wrapper only gives what ExecuTorch's ``MultimodalRunner`` feeds
and takes: ``[W, bins, frames]`` log-mel features of W 30-second windows in (the preprocessor's stacked output),
``[1, W * N, hidden]`` out, the N positions per window the runner gives the audio in the text decoder. Gemma 4's and
Granite Speech's conformers take one recording of any length instead (``models.gemma4_audio``,
``models.granite_speech``); the functions here build any of them.
Parity with transformers' own audio features: tests/test_audio_language.py, tests/test_gemma4_audio.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from models.audio_language import AudioGeometry, audio_language_of
from models.gemma4_audio import Gemma4Audio, gemma4_audio_parameters, load_gemma4_audio, random_gemma4_audio
from models.granite_speech import (GraniteSpeechAudio, granite_speech_audio_parameters, load_granite_speech_audio,
                                   random_granite_speech_audio)
from models.towers import delegated_norms, load_parts, meta_model, quiet_transformers


class AudioEncoder(nn.Module):
    """``forward(features [W, bins, frames]) -> [1, W * N, hidden]``."""

    def __init__(self, config: Any, geometry: AudioGeometry, tower: nn.Module, projector: nn.Module) -> None:
        super().__init__()
        self.geometry = geometry
        self.tower, self.projector = tower, projector
        self.compute_dtype = torch.float32  # what its weights and activations are in (quant.audio)
        self.out_dtype = torch.float32  # what the text decoder takes: MultimodalRunner converts nothing

    def describe(self) -> str:
        g = self.geometry
        params = sum(p.numel() for p in self.parameters())
        return f"{params / 1e6:.2f}M parameters, {g.bins} mel bins x {g.frames} frames -> {g.tokens} positions per 30 s"

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.embeddings(features.to(self.compute_dtype)).to(self.out_dtype)

    def embeddings(self, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class VoxtralAudio(AudioEncoder):
    """Whisper's encoder on each window, then ``intermediate_size / hidden_size`` consecutive states stacked into one
    row and projected (transformers' ``VoxtralModel.get_audio_features``), the windows one after the other."""

    def __init__(self, config: Any, geometry: AudioGeometry, tower: nn.Module, projector: nn.Module) -> None:
        super().__init__(config, geometry, tower, projector)
        self.stacked = config.audio_config.intermediate_size

    def embeddings(self, features: torch.Tensor) -> torch.Tensor:
        states = self.tower(features).last_hidden_state
        return self.projector(states.reshape(-1, self.stacked)).unsqueeze(0)


class Qwen2Audio(AudioEncoder):
    """Whisper's encoder with its average pool, then one linear: a whole 30 s window (the processor pads every
    recording to one), so no frame is masked."""

    def embeddings(self, features: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(features).last_hidden_state).reshape(1, -1, self.projector.linear.out_features)


ENCODERS: dict[str, type[AudioEncoder]] = {"voxtral": VoxtralAudio, "qwen2_audio": Qwen2Audio}

# Where a checkpoint keeps the tower's and the projector's tensors: the hub's ``audio_tower.*`` and transformers 5's
# ``model.audio_tower.*``.
PART_PREFIXES: dict[str, tuple[str, ...]] = {
    "tower": ("model.audio_tower.", "audio_tower."),
    "projector": ("model.multi_modal_projector.", "multi_modal_projector.")}


def _parts(model: Any) -> tuple[nn.Module, nn.Module]:
    return model.model.audio_tower, model.model.multi_modal_projector


def _new_parts(hf_config: Any) -> tuple[nn.Module, nn.Module]:
    """The tower and projector of ``hf_config``'s architecture in fp32 with transformers' initialization, built alone.
    Eager attention: SDPA lowers to checks for fully masked rows on every [heads, 1500, 1500] score matrix."""
    hf_config._attn_implementation = "eager"
    hf_config.audio_config._attn_implementation = "eager"
    tower, projector = _parts(meta_model(hf_config))
    with quiet_transformers():
        return type(tower)(hf_config.audio_config), type(projector)(hf_config)


def _encoder(hf_config: Any, parts: tuple[nn.Module, nn.Module]) -> AudioEncoder:
    family = audio_language_of(hf_config)
    assert family is not None, "an audio-language config"
    return delegated_norms(ENCODERS[family.name](hf_config, family.geometry(hf_config), *parts)).eval()


@dataclass(frozen=True)
class OwnEncoder:
    """A family whose encoder is not Whisper's windows: its loader, its random builder, its parameter count."""

    load: Callable[[str, Any], nn.Module]
    random: Callable[[Any, int], nn.Module]
    parameters: Callable[[Any], int]


OWN_ENCODERS: dict[str, OwnEncoder] = {
    "gemma4": OwnEncoder(load_gemma4_audio, random_gemma4_audio, gemma4_audio_parameters),
    "granite_speech": OwnEncoder(load_granite_speech_audio, random_granite_speech_audio,
                                 granite_speech_audio_parameters)}


def _own(hf_config: Any) -> OwnEncoder | None:
    family = audio_language_of(hf_config)
    return OWN_ENCODERS.get(family.name) if family is not None else None


def load_audio_encoder(path: str, hf_config: Any) -> AudioEncoder | Gemma4Audio | GraniteSpeechAudio:
    """The audio encoder of the checkpoint folder ``path`` in fp32, only its tensors read."""
    own = _own(hf_config)
    if own is not None:
        return own.load(path, hf_config)
    tower, projector = _new_parts(hf_config)
    load_parts(path, {"tower": tower, "projector": projector}, PART_PREFIXES)
    return _encoder(hf_config, (tower, projector))


def random_audio_encoder(hf_config: Any, seed: int = 0) -> AudioEncoder | Gemma4Audio | GraniteSpeechAudio:
    """The audio encoder of ``hf_config``'s shape with seeded random weights (transformers' own initialization)."""
    own = _own(hf_config)
    if own is not None:
        return own.random(hf_config, seed)
    torch.manual_seed(seed)
    return _encoder(hf_config, _new_parts(hf_config))


def audio_parameters(hf_config: Any) -> int:
    """The tower's and projector's parameters, counted on the meta device: nothing allocated."""
    own = _own(hf_config)
    if own is not None:
        return own.parameters(hf_config)
    return sum(p.numel() for part in _parts(meta_model(hf_config)) for p in part.parameters())
