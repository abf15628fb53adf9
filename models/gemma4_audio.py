"""Gemma 4's audio tower on one recording: log-mel frames in, the text decoder's audio embeddings out.

transformers runs ``Gemma4AudioModel`` on the feature extractor's frames with a mask of the valid ones (a batch is
padded to its longest recording), then ``embed_audio``, then strips the padded positions by a boolean index, which
``torch.export`` cannot keep. For one recording the mask is known from the frames themselves: the feature extractor
writes zeros in every padded frame, and a real log-mel frame is never all zeros (``log(mel + 0.001)``). So the method
takes ``[1, 128, 4m]`` frames (ExecuTorch's ``MultimodalRunner`` passes its audio input as ``[batch, bins, frames]``,
unchanged), the recording's frames padded with zeros to a multiple of 4, and gives ``[1, m, hidden + 3]``: exactly
the recording's ``ceil(ceil(F / 2) / 2)`` audio positions (two stride-2 convolutions), each carrying the audio
token's id (``models.decoder.ID_DIGITS``) for the per-layer embeddings, as ``models.vision_encoder.Gemma4Vision``
does for images. Inside the graph 48 more zero frames are appended and masked: with fewer than two of the tower's
attention blocks ``torch.export`` specializes the frame count to short recordings only.

:class:`Gemma4LogMel` turns raw 16 kHz samples into those frames: ExecuTorch's own ``Gemma4SpeechTransformModel``
(``examples/models/gemma4/speech_transform.py``, transformers' ``Gemma4AudioFeatureExtractor`` in torch ops), then
the zero frames up to a multiple of 4.

In a program it is the audio component's ``audio_encoder`` (``exporters.components.audio``), built through
``models.audio_encoder``; ``preprocessor.pte`` beside the program is :class:`Gemma4LogMel`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from models.audio_language import GEMMA4_FRAMES_PER_TOKEN, GEMMA4_MEL_BINS, AudioGeometry, audio_language_of
from models.decoder import id_digits
from models.errors import ModelError
from models.towers import (clip_bounds, clipped_linear, delegated_norms, gemma4_rms_norm, load_parts, meta_model,
                           quiet_transformers)

MEL_BINS = GEMMA4_MEL_BINS  # fixed by the tower's subsampling convolutions (Gemma4AudioConfig has no num_mel_bins)
FRAMES_PER_TOKEN = GEMMA4_FRAMES_PER_TOKEN  # two stride-2 convolutions
# Zero frames appended inside the graph (masked): two of the tower's 12-frame attention blocks at the convolutions'
# quarter rate, whatever the recording, so the exported frame count keeps its whole range.
EXTRA_FRAMES = 48
SAMPLE_RATE = 16_000

# Where checkpoints keep the tower's and the embedder's tensors (transformers 5's layout first).
PART_PREFIXES: dict[str, tuple[str, ...]] = {
    "tower": ("model.audio_tower.", "audio_tower."),
    "projector": ("model.embed_audio.", "embed_audio.")}


def audio_positions(frames: int) -> int:
    """The audio positions transformers gives ``frames`` valid log-mel frames: ``ceil(ceil(frames / 2) / 2)``."""
    return math.ceil(math.ceil(frames / 2) / 2)


def padded_frames(frames: int) -> int:
    """The frames the program takes for ``frames`` valid ones: zeros up to a multiple of :data:`FRAMES_PER_TOKEN`,
    which leaves the positions as they are (``audio_positions``)."""
    return -(-frames // FRAMES_PER_TOKEN) * FRAMES_PER_TOKEN


class Gemma4Audio(nn.Module):
    """``forward(features [1, 128, 4m]) -> [1, m, hidden + 3]`` (module docstring)."""

    def __init__(self, config: Any, tower: nn.Module, projector: nn.Module) -> None:
        super().__init__()
        family = audio_language_of(config)
        assert family is not None, "a Gemma 4 config with audio_config"
        self.geometry: AudioGeometry = family.geometry(config)
        self.tower, self.projector = delegable(tower), delegable(projector)
        self.register_buffer("token_id", id_digits(torch.tensor([[self.geometry.audio_token_id]]), torch.float32),
                             persistent=False)
        self.compute_dtype = torch.float32  # what its weights and activations are in (quant.audio)
        self.out_dtype = torch.float32  # what the text decoder takes: MultimodalRunner converts nothing

    def describe(self) -> str:
        params = sum(p.numel() for p in self.parameters())
        return (f"{params / 1e6:.2f}M parameters, {MEL_BINS} mel bins, {FRAMES_PER_TOKEN} frames a position, "
                f"up to {self.geometry.tokens} positions (30 s)")

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.embeddings(features.to(self.compute_dtype)).to(self.out_dtype)

    def embeddings(self, features: torch.Tensor) -> torch.Tensor:
        frames = features.transpose(1, 2)  # [1, 4m, bins]: the tower's layout
        positions = frames.shape[1] // FRAMES_PER_TOKEN
        frames = F.pad(frames, (0, 0, 0, EXTRA_FRAMES))
        valid = (frames != 0).any(dim=-1)  # padded frames are all zeros (the feature extractor's own padding)
        states = self.tower(frames, valid).last_hidden_state[:, :positions]
        out = self.projector(states)
        return torch.cat([out, self.token_id.to(out.dtype).expand(1, positions, -1)], dim=-1)


class _ClampedByNumbers(nn.Module):
    """``Gemma4ClippableLinear`` with its bounds read once as numbers (``models.towers.clipped_linear``): XNNPACK takes
    a clamp by numbers, not one by tensors, which would end a delegated partition at each of the tower's linears."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clipped_linear(self, x)


class _DelegatedRMSNorm(nn.Module):
    """``Gemma4RMSNorm`` through ops XNNPACK delegates (``models.towers.gemma4_rms_norm``): equal within float
    rounding (tests/test_gemma4_audio.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() not in (3, 4) or x.shape[0] != 1:
            return type(self).__mro__[1].forward(self, x)  # transformers' own
        return gemma4_rms_norm(self, x)


def delegable(module: nn.Module) -> nn.Module:
    """``module`` (the tower or ``embed_audio``) with its clipped linears, RMS norms and layer norms computed in ops
    XNNPACK delegates, in place (the same parameters; each swapped module's class derives from transformers')."""
    for m in module.modules():
        name = type(m).__name__
        if name == "Gemma4ClippableLinear":
            m.bounds = clip_bounds(m)
            m.__class__ = type("Gemma4ClippableLinearByNumbers", (_ClampedByNumbers, type(m)), {})
        elif name == "Gemma4RMSNorm":
            m.__class__ = type("Gemma4RMSNormDelegated", (_DelegatedRMSNorm, type(m)), {})
    return delegated_norms(module)


class Gemma4LogMel(nn.Module):
    """``forward(samples [n]) -> [1, 128, 4m]``: 16 kHz mono samples to the frames :class:`Gemma4Audio` takes."""

    def __init__(self) -> None:
        super().__init__()
        from executorch.examples.models.gemma4.speech_transform import Gemma4SpeechTransformModel

        self.mel = Gemma4SpeechTransformModel(sample_rate=SAMPLE_RATE, n_mels=MEL_BINS)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        mel = self.mel(samples)  # [F, bins]
        frames = mel.shape[0]
        pad = (FRAMES_PER_TOKEN - frames % FRAMES_PER_TOKEN) % FRAMES_PER_TOKEN
        return F.pad(mel, (0, 0, 0, pad)).T.unsqueeze(0)


def _new_parts(hf_config: Any) -> tuple[nn.Module, nn.Module]:
    """The tower and ``embed_audio`` of ``hf_config`` in fp32 with transformers' initialization, built alone."""
    if getattr(hf_config, "audio_config", None) is None:
        raise ModelError(f"{hf_config.architectures[0]}'s config.json has no audio_config: this checkpoint has no "
                         "audio tower.")
    hf_config.audio_config._attn_implementation = "eager"
    whole = meta_model(hf_config).model
    tower, embed = whole.audio_tower, whole.embed_audio
    with quiet_transformers():
        return (type(tower)(hf_config.audio_config).eval(),
                type(embed)(hf_config.audio_config, hf_config.text_config).eval())


def load_gemma4_audio(path: str, hf_config: Any) -> Gemma4Audio:
    """The audio encoder of the Gemma 4 checkpoint folder ``path`` in fp32, only its tensors read."""
    tower, projector = _new_parts(hf_config)
    load_parts(path, {"tower": tower, "projector": projector}, PART_PREFIXES)
    return Gemma4Audio(hf_config, tower, projector).eval()


def random_gemma4_audio(hf_config: Any, seed: int = 0) -> Gemma4Audio:
    """The audio encoder of ``hf_config``'s shape with seeded random weights (transformers' own initialization)."""
    torch.manual_seed(seed)
    return Gemma4Audio(hf_config, *_new_parts(hf_config)).eval()


def gemma4_audio_parameters(hf_config: Any) -> int:
    """The tower's and ``embed_audio``'s parameters, counted on the meta device: nothing allocated."""
    whole = meta_model(hf_config).model
    return sum(p.numel() for part in (whole.audio_tower, whole.embed_audio) for p in part.parameters())
