"""An audio encoder in the program: its method, its constants, and the prompt around audio.

The kind itself (planning, building, quantizing, validating it) is ``exporters.components.audio``. Its method,
``audio_encoder``, takes log-mel features of W 30-second windows ``[W, bins, frames]`` (what ``preprocessor.pte``
beside the program makes of raw 16 kHz samples, ExecuTorch's ``WhisperAudioProcessor`` with ``stack_output``) and
gives ``[1, W * N, hidden]`` embeddings, which ExecuTorch's ``MultimodalRunner`` feeds to ``text_decoder`` in one
call (``multimodal_prefiller.cpp``: an ``Audio`` input goes to ``audio_encoder`` as it is, and its output's second
dimension is the positions it takes). Gemma 4's takes one recording of any length instead, ``[1, bins, 4m]``, and
gives its ``m`` positions; its ``preprocessor.pte`` is ExecuTorch's ``Gemma4SpeechTransformModel``
(``models.gemma4_audio.Gemma4LogMel``). Granite Speech's takes one recording's ``[1, T, 160]`` encoder frames (any T)
and gives ``3 * ceil(T / 15)`` positions; its preprocessor is ``models.granite_speech.GraniteLogMel``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from exporters.program.dynamic import convolutions_unguarded
from exporters.program.methods import MethodSpec
from exporters.program.speech import (CHUNK_SECONDS, SAMPLE_RATE, copy_cached_program, preprocessor_features,
                                      write_preprocessor)
from models.audio_language import AudioGeometry
from models.gemma4_audio import Gemma4LogMel
from models.granite_speech import MIN_SAMPLES as GRANITE_MIN_SAMPLES
from models.granite_speech import GraniteLogMel

AUDIO = "audio"  # the component's name (its buffers' prefix)
AUDIO_METHOD = "audio_encoder"  # the method ExecuTorch's MultimodalRunner calls for audio
# Our constant methods beside the runner's: what an app needs to turn a recording into the method's input.
AUDIO_TOKENS, AUDIO_TOKEN_ID, MAX_WINDOWS = "get_audio_tokens", "get_audio_token_id", "get_max_audio_windows"
# A recording of any length (Gemma 4): frames a position, and the tokens written before and after its positions.
FRAMES_PER_TOKEN = "get_audio_frames_per_token"
AUDIO_BEGIN_ID, AUDIO_END_ID = "get_audio_begin_token_id", "get_audio_end_token_id"
# Granite Speech: positions per window of frames (the last partial), its frames' rate and axis ([1, frames, bins]).
FRAME_WINDOW, FRAME_RATE, FRAMES_AXIS = "get_audio_frame_window", "get_audio_frames_per_second", "get_audio_frames_axis"
# Where text_decoder applies the checkpoint's adapter for prompts with audio (Granite Speech), its name: such a prompt is
# continued through token_embedding and text_decoder, as ExecuTorch's MultimodalRunner continues every prompt, not
# through the text methods, which compute the base.
TEXT_DECODER_ADAPTER = "get_text_decoder_adapter"


def audio_spec(geometry: AudioGeometry, size: int) -> MethodSpec:
    """``audio_encoder``: 1 to ``size`` 30 s windows a call (exactly one when ``size`` is 1); a recording of any
    length (``geometry.any_length``): 1 to ``size`` positions."""
    if geometry.frame_window:
        return MethodSpec(AUDIO_METHOD, 1, size, True, takes="frames", gives="embeddings", bins=geometry.bins,
                          frames_per_token=geometry.frames_per_token, frames_axis=1,
                          any_frames=geometry.frames_for(size))
    if geometry.any_length:
        return MethodSpec(AUDIO_METHOD, 1, size, True, takes="frames", gives="embeddings", bins=geometry.bins,
                          frames_per_token=geometry.frames_per_token)
    return MethodSpec(AUDIO_METHOD, 1, size, size > 1, takes="features", gives="embeddings",
                      features=(geometry.bins, geometry.frames))


def audio_constants(geometry: AudioGeometry, size: int) -> dict[str, Any]:
    """Named as a speech program's are (``get_sample_rate``, ``get_num_mel_bins``, ...), and the audio's tokens:
    per window and the windows a call (``size``); for a recording of any length, the most positions a call gives
    (``size``: ``get_audio_tokens``), the frames a position, and the tokens around them."""
    values = {"get_sample_rate": SAMPLE_RATE, "get_num_mel_bins": geometry.bins, "get_chunk_length": CHUNK_SECONDS,
              "get_n_frames": geometry.frames, AUDIO_TOKEN_ID: geometry.audio_token_id}
    if not geometry.any_length:
        return {**values, AUDIO_TOKENS: geometry.tokens, MAX_WINDOWS: size}
    values["get_n_frames"] = geometry.frames_for(size)
    values.update({AUDIO_TOKENS: size, MAX_WINDOWS: 1, FRAMES_PER_TOKEN: geometry.frames_per_token})
    if geometry.begin_token_id is not None and geometry.end_token_id is not None:
        values.update({AUDIO_BEGIN_ID: geometry.begin_token_id, AUDIO_END_ID: geometry.end_token_id})
    if geometry.frame_window:
        values.update({FRAME_WINDOW: geometry.frame_window, FRAME_RATE: geometry.frames_per_second, FRAMES_AXIS: 1})
    return values


#: The preprocessor of each family whose encoder takes one recording of any length.
LOG_MELS: dict[str, type[torch.nn.Module]] = {"gemma4": Gemma4LogMel, "granite_speech": GraniteLogMel}


def audio_features(samples: torch.Tensor, geometry: AudioGeometry) -> torch.Tensor:
    """What the program's preprocessor makes of 16 kHz mono ``samples``, in PyTorch: Whisper's windows
    ``[W, bins, 3000]``, Gemma 4's frames ``[1, 128, 4m]``, Granite Speech's ``[1, T, 160]``."""
    if not geometry.any_length:
        return preprocessor_features(samples, geometry.bins)
    with torch.no_grad():
        return LOG_MELS[geometry.family]()(samples)


def cropped(features: torch.Tensor, geometry: AudioGeometry, positions: int) -> torch.Tensor:
    """The first frames of one recording's ``features`` that give at most ``positions`` positions."""
    frames = geometry.frames_for(positions)
    return (features[:, :frames] if geometry.time_major else features[..., :frames]).contiguous()


#: Log-mel frames a second: a hop of 10 ms (Whisper's and Gemma 4's feature extractors).
FRAMES_PER_SECOND = 100
#: The longest recording Gemma 4's preprocessor takes: its feature extractor's 30 s (max_length 480,000 samples);
#: the shortest: one frame (20 ms, a hop of 10 ms and a sample). Granite Speech's the same 30 s, at least one encoder
#: frame.
GEMMA4_MAX_SAMPLES, GEMMA4_MIN_SAMPLES = 30 * SAMPLE_RATE, 320 + 160 + 1
MIN_SAMPLES = {"gemma4": GEMMA4_MIN_SAMPLES, "granite_speech": GRANITE_MIN_SAMPLES}


def write_audio_preprocessor(path: Path, geometry: AudioGeometry) -> str:
    """The preprocessor of ``geometry``'s family written to ``path``; what it is, for the console."""
    if not geometry.any_length:
        write_preprocessor(path, geometry.bins)
        return f"ExecuTorch's WhisperAudioProcessor, raw 16 kHz samples to {geometry.bins}-bin features"
    _write_log_mel(path, geometry.family)
    if geometry.family == "gemma4":
        return "ExecuTorch's Gemma4SpeechTransformModel, raw 16 kHz samples (up to 30 s) to 128-bin frames"
    return f"{geometry.family}'s log-mel in torch ops, raw 16 kHz samples (up to 30 s) to {geometry.bins}-wide frames"


def _write_log_mel(path: Path, family: str) -> None:
    """The family's log-mel (:data:`LOG_MELS`) lowered to XNNPACK: samples ``[N]`` (from its fewest to 30 s) in, one
    recording's frames out."""
    def make(out: Path) -> None:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

        model = LOG_MELS[family]().eval()
        samples = torch.export.Dim("samples", min=MIN_SAMPLES[family], max=GEMMA4_MAX_SAMPLES)
        with torch.no_grad():
            program = torch.export.export(model, (torch.randn(SAMPLE_RATE),), dynamic_shapes=({0: samples},),
                                          strict=False)
        # Its STFT framing (unfold) is outside the Edge dialect's operator set, as in ExecuTorch's own export.
        with convolutions_unguarded():
            lowered = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()],
                                                  compile_config=EdgeCompileConfig(_check_ir_validity=False))
            out.write_bytes(lowered.to_executorch().buffer)

    copy_cached_program(path, "gemma4-mel128-30s" if family == "gemma4" else f"{family}-log-mel-30s", make)
