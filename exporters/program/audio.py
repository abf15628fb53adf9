"""An audio encoder in the program: its method, its constants, and the prompt around audio.

The kind itself (planning, building, quantizing, validating it) is ``exporters.components.audio``. Its method,
``audio_encoder``, takes log-mel features of W 30-second windows ``[W, bins, frames]`` (what ``preprocessor.pte``
beside the program makes of raw 16 kHz samples, ExecuTorch's ``WhisperAudioProcessor`` with ``stack_output``) and
gives ``[1, W * N, hidden]`` embeddings, which ExecuTorch's ``MultimodalRunner`` feeds to ``text_decoder`` in one
call (``multimodal_prefiller.cpp``: an ``Audio`` input goes to ``audio_encoder`` as it is, and its output's second
dimension is the positions it takes).
"""

from __future__ import annotations

from typing import Any

from exporters.program.methods import MethodSpec
from exporters.program.speech import CHUNK_SECONDS, SAMPLE_RATE
from models.audio_language import AudioGeometry

AUDIO = "audio"  # the component's name (its buffers' prefix)
AUDIO_METHOD = "audio_encoder"  # the method ExecuTorch's MultimodalRunner calls for audio
# Our constant methods beside the runner's: what an app needs to turn a recording into the method's input.
AUDIO_TOKENS, AUDIO_TOKEN_ID, MAX_WINDOWS = "get_audio_tokens", "get_audio_token_id", "get_max_audio_windows"


def audio_spec(geometry: AudioGeometry, windows: int) -> MethodSpec:
    """``audio_encoder``: 1 to ``windows`` 30 s windows a call (exactly one when ``windows`` is 1)."""
    return MethodSpec(AUDIO_METHOD, 1, windows, windows > 1, takes="features", gives="embeddings",
                      features=(geometry.bins, geometry.frames))


def audio_constants(geometry: AudioGeometry, windows: int) -> dict[str, Any]:
    """Named as a speech program's are (``get_sample_rate``, ``get_num_mel_bins``, ...), and the audio's tokens."""
    return {"get_sample_rate": SAMPLE_RATE, "get_num_mel_bins": geometry.bins, "get_chunk_length": CHUNK_SECONDS,
            "get_n_frames": geometry.frames, AUDIO_TOKENS: geometry.tokens, AUDIO_TOKEN_ID: geometry.audio_token_id,
            MAX_WINDOWS: windows}
