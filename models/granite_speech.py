"""Granite Speech's audio encoder and log-mel features: one recording in, the text decoder's audio embeddings out.

transformers' ``GraniteSpeechCTCEncoder`` (a conformer whose attention works in blocks of ``context_size`` frames,
the last block padded and masked) and ``GraniteSpeechEncoderProjector`` (a Q-Former turning each window of 15
encoder frames into 3 positions, the last window padded with zeros) decide their block counts with Python branches
on the frame count, which ``torch.export`` turns into guards that pin the count. :class:`GraniteSpeechAudio` computes
the same thing with transformers' own modules and weights and a fixed number of blocks under export (enough for the
most frames the method takes; blocks past the recording are masked, or cut from the output), so the frame count
stays dynamic: ``[1, T, 160]`` (T encoder frames of two stacked 80-bin log-mel frames, 50 a second) in,
``[1, 3 * ceil(T / 15), hidden]`` out, scaled by the text decoder's ``embedding_multiplier`` (transformers scales the
merged embeddings, audio rows included, inside ``GraniteModel``; ``token_embedding`` scales the text rows).
Eagerly the block counts are the recording's own. Parity with transformers' ``get_audio_features``:
tests/test_audio_language.py.

:class:`GraniteLogMel` is ``GraniteSpeechFeatureExtractor`` (torchaudio's ``MelSpectrogram``, then log10, a floor 8
below the recording's maximum, ``/ 4 + 1``, an odd last frame dropped, pairs stacked) in torch ops, without
torchaudio (no wheel of it is built for the torch we pin): the program's ``preprocessor.pte``. Its features equal
transformers' own numpy ``spectrogram`` with the same window and filters (tests/test_audio_language.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from models.audio_language import AudioGeometry, audio_language_of
from models.errors import ModelError
from models.towers import delegated_norms, load_parts, meta_model, quiet_transformers

SAMPLE_RATE, N_FFT, WIN_LENGTH, HOP_LENGTH, MEL_BINS = 16_000, 512, 400, 160, 80  # the feature extractor's defaults
STACKED = 2  # log-mel frames stacked into one encoder frame
# The shortest recording the preprocessor takes: 30 ms, four log-mel frames (two encoder frames; with one, export would
# specialize the frame count).
MIN_SAMPLES = 3 * HOP_LENGTH

# Where checkpoints keep the encoder's and the projector's tensors (transformers 5's layout first).
PART_PREFIXES: dict[str, tuple[str, ...]] = {"encoder": ("model.encoder.", "encoder."),
                                             "projector": ("model.projector.", "projector.")}


def mel_filters() -> np.ndarray:
    """torchaudio's ``melscale_fbanks`` for the feature extractor's ``MelSpectrogram`` (HTK scale, no norm, 0 to 8 kHz),
    as transformers computes it: ``[257, 80]``."""
    from transformers.audio_utils import mel_filter_bank

    return mel_filter_bank(num_frequency_bins=N_FFT // 2 + 1, num_mel_filters=MEL_BINS, min_frequency=0.0,
                           max_frequency=SAMPLE_RATE / 2, sampling_rate=SAMPLE_RATE, norm=None, mel_scale="htk")


def stacked_log_mel(power_mel: torch.Tensor) -> torch.Tensor:
    """``[F, 80]`` mel power to the encoder's ``[1, F // 2, 160]`` frames, as the feature extractor does it: the floor
    and scale over the whole recording (its last odd frame included), then pairs of frames side by side (picked by
    index, which keeps the frame count free under export)."""
    logmel = power_mel.clamp(min=1e-10).log10()
    logmel = torch.maximum(logmel, logmel.amax() - 8.0) / 4 + 1
    first = torch.arange(logmel.shape[0] // STACKED) * STACKED
    return torch.cat([logmel.index_select(0, first + i) for i in range(STACKED)], dim=-1).unsqueeze(0)


class GraniteLogMel(nn.Module):
    """``forward(samples [N]) -> [1, T, 160]``: 16 kHz mono samples to the frames :class:`GraniteSpeechAudio` takes;
    torchaudio's STFT (centered frames, reflect padding, the 400-sample Hann window in the middle of 512) as frames
    times the window and a real FFT, as ExecuTorch's own Gemma 4 preprocessor computes it."""

    def __init__(self) -> None:
        super().__init__()
        window = torch.zeros(N_FFT)
        start = (N_FFT - WIN_LENGTH) // 2
        window[start:start + WIN_LENGTH] = torch.hann_window(WIN_LENGTH, periodic=True)
        self.register_buffer("window", window, persistent=False)
        self.register_buffer("filters", torch.from_numpy(mel_filters()).float(), persistent=False)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        padded = F.pad(samples[None, None], (N_FFT // 2, N_FFT // 2), mode="reflect")[0, 0]
        frames = padded.unfold(0, N_FFT, HOP_LENGTH) * self.window  # [F, 512], F = N // 160 + 1
        power = torch.fft.rfft(frames, n=N_FFT, dim=-1).abs() ** 2  # [F, 257]
        return stacked_log_mel(torch.matmul(power, self.filters))


def reference_features(samples: np.ndarray) -> np.ndarray:
    """The feature extractor's frames computed by transformers' own numpy ``spectrogram`` (float64), for checking
    :class:`GraniteLogMel`: ``[1, T, 160]``."""
    from transformers.audio_utils import spectrogram, window_function

    window = window_function(WIN_LENGTH, "hann", periodic=True, frame_length=N_FFT)
    power_mel = spectrogram(samples.astype(np.float64), window, frame_length=N_FFT, hop_length=HOP_LENGTH,
                            fft_length=N_FFT, power=2.0, center=True, pad_mode="reflect", mel_filters=mel_filters(),
                            mel_floor=0.0)  # [80, F]
    return stacked_log_mel(torch.from_numpy(power_mel.T)).numpy()


class GraniteSpeechAudio(nn.Module):
    """``forward(features [1, T, 160]) -> [1, 3 * ceil(T / 15), hidden]`` (module docstring)."""

    def __init__(self, config: Any, encoder: nn.Module, projector: nn.Module) -> None:
        super().__init__()
        family = audio_language_of(config)
        assert family is not None, "a Granite Speech config"
        self.geometry: AudioGeometry = family.geometry(config)
        self.encoder, self.projector = delegated_norms(encoder), delegated_norms(projector)
        self.scale = float(config.text_config.embedding_multiplier)
        # The most frames a call takes (the exported method's bound): the blocks computed under export.
        self.max_frames = self.geometry.frames
        self.compute_dtype = torch.float32  # what its weights and activations are in (quant.audio)
        self.out_dtype = torch.float32  # what the text decoder takes: MultimodalRunner converts nothing

    def describe(self) -> str:
        params = sum(p.numel() for p in self.parameters())
        g = self.geometry
        return (f"{params / 1e6:.2f}M parameters, {g.bins}-wide frames (two 80-bin frames each), "
                f"{g.frame_window} frames to {g.frame_window // g.frames_per_token} positions, up to {g.tokens}")

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.embeddings(features.to(self.compute_dtype)).to(self.out_dtype)

    def embeddings(self, features: torch.Tensor) -> torch.Tensor:
        return self.projected(self.encoded(features)) * self.scale

    def blocks(self, frames: Any, size: int) -> Any:
        """How many blocks of ``size`` frames a call computes: the recording's own eagerly, a fixed count for
        :attr:`max_frames` under export (module docstring)."""
        if torch.compiler.is_exporting():
            return -(-self.max_frames // size)
        return -(-frames // size)

    def encoded(self, features: torch.Tensor) -> torch.Tensor:
        """``GraniteSpeechCTCEncoder.forward``: its layers, and the CTC head's softmax fed back halfway. The frames'
        blocks and the mask of what lies past the recording are the same in every layer: made once."""
        e = self.encoder
        frames, size = features.shape[1], e.config.context_size
        n = self.blocks(frames, size)
        index, valid = _blocks(frames, n, size)
        # -max where a query or a key lies past the recording, added where transformers fills: the same values
        blocked = torch.where(valid[:, None, :, None] & valid[:, None, None, :], 0.0, -torch.finfo(features.dtype).max)
        h = e.input_linear(features)
        for number, layer in enumerate(e.layers, start=1):
            h = 0.5 * layer.ff1(h) + h
            h = self.attention(layer.attn, h, index, blocked) + h
            h = layer.conv(h) + h
            h = 0.5 * layer.ff2(h) + h
            h = layer.post_norm(h)
            if number == e.num_layers // 2:
                h = h + e.out_mid(torch.softmax(e.out(h), dim=-1))
        return h

    def attention(self, attn: nn.Module, h: torch.Tensor, index: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """``GraniteSpeechConformerAttention.forward``: Shaw's relative positions within blocks of ``context_size``
        frames (``index``: each block's frames), every frame past the recording masked (``blocked``; transformers
        masks the last block's alone: the others hold none), in ops whose shapes do not depend on the frame count."""
        h = attn.pre_norm(h)
        frames, size, heads, dim = h.shape[1], attn.context_size, attn.num_heads, attn.dim_head
        n = index.shape[0]

        def per_block(x: torch.Tensor) -> torch.Tensor:  # [1, T, heads * dim] -> [n, heads, size, dim]
            return x.index_select(1, index.flatten()).reshape(n, size, heads, dim).transpose(1, 2)

        q = per_block(attn.to_q(h))
        k, v = (per_block(x) for x in attn.to_kv(h).chunk(2, dim=-1))
        rel = attn.rel_pos_emb(self.encoder.attention_dists).transpose(1, 2)  # [size, dim, size]
        positional = torch.bmm(q.permute(2, 0, 1, 3).reshape(size, n * heads, dim), rel)
        positional = positional.reshape(size, n, heads, size).permute(1, 2, 0, 3) * attn.scale + blocked
        scores = torch.matmul(q, k.transpose(-1, -2)) * attn.scale + positional
        out = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(1, n * size, heads * dim)
        return attn.to_out(out[:, :frames])

    def projected(self, h: torch.Tensor) -> torch.Tensor:
        """``GraniteSpeechEncoderProjector.forward``: the Q-Former's queries over each window of frames (zeros past
        the recording), projected to the text decoder's width; the windows past the recording's cut off."""
        p = self.projector
        frames, window, per_window = h.shape[1], p.window_size, p.num_queries
        n = self.blocks(frames, window)
        index, valid = _blocks(frames, n, window)
        windows = torch.where(valid[..., None], h.index_select(1, index.flatten()).reshape(n, window, h.shape[-1]),
                              0.0)
        out = p.qformer(query_embeds=p.query.expand(n, -1, -1), encoder_hidden_states=windows,
                        encoder_attention_mask=None, return_dict=True).last_hidden_state
        keep = (frames + window - 1) // window * per_window  # this form: export bounds it (3 and up)
        return p.linear(out.reshape(1, n * per_window, out.shape[-1])[:, :keep])


def _blocks(frames: Any, n: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, size]`` frame indices of ``n`` blocks of ``size`` frames (past the last frame: the last frame's, any
    finite values do), and which are the recording's."""
    index = torch.arange(n).unsqueeze(1) * size + torch.arange(size).unsqueeze(0)
    return index.clamp(max=frames - 1), index < frames


def _new_parts(hf_config: Any) -> tuple[nn.Module, nn.Module]:
    """The encoder and projector of ``hf_config`` in fp32 with transformers' initialization, built alone."""
    if getattr(hf_config, "encoder_config", None) is None:
        raise ModelError(f"{hf_config.architectures[0]}'s config.json has no encoder_config: this checkpoint has no "
                         "audio encoder.")
    whole = meta_model(hf_config).model
    with quiet_transformers():
        encoder = type(whole.encoder)(hf_config.encoder_config)
        projector = type(whole.projector)(hf_config)
    return encoder.eval(), projector.eval()


def load_granite_speech_audio(path: str, hf_config: Any) -> GraniteSpeechAudio:
    """The audio encoder of the Granite Speech checkpoint folder ``path`` in fp32, only its tensors read."""
    encoder, projector = _new_parts(hf_config)
    load_parts(path, {"encoder": encoder, "projector": projector}, PART_PREFIXES)
    return GraniteSpeechAudio(hf_config, encoder, projector).eval()


def random_granite_speech_audio(hf_config: Any, seed: int = 0) -> GraniteSpeechAudio:
    """The audio encoder of ``hf_config``'s shape with seeded random weights (transformers' own initialization)."""
    torch.manual_seed(seed)
    return GraniteSpeechAudio(hf_config, *_new_parts(hf_config)).eval()


def granite_speech_audio_parameters(hf_config: Any) -> int:
    """The encoder's and projector's parameters, counted on the meta device: nothing allocated."""
    whole = meta_model(hf_config).model
    return sum(p.numel() for part in (whole.encoder, whole.projector) for p in part.parameters())
