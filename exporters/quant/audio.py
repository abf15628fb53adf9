"""``quant.audio``: the scheme an audio encoder's linear layers get, apart from the decoder's (Whisper's encoder in a
speech program, an audio-language model's tower and projector)."""

from __future__ import annotations

from typing import Any

from torch import nn

from exporters.quant.linears import quantize_linears

# quant.audio: fp32; 8da8w (int8 weights per channel, int8 activations per token at run time); 8da4w (int4 weights
# in groups of quant.group_size). The convolutions and norms stay in float.
AUDIO_SCHEMES = ("fp32", "8da8w", "8da4w")
# quant.audio=auto: the scheme beside a decoder whose linear layers are quantized (measured: docs/speech.md), and
# beside a float one.
AUTO, AUTO_QUANTIZED, AUTO_FLOAT = "auto", "8da8w", "fp32"


def audio_scheme(quant: Any) -> str:
    """The scheme ``quant.audio`` gives the audio encoder (``auto`` resolved by the decoder's linear scheme)."""
    if quant.audio != AUTO:
        return quant.audio
    return AUTO_QUANTIZED if quant.linear else AUTO_FLOAT


def quantize_audio(encoder: nn.Module, scheme: str, group_size: int) -> str:
    """``scheme`` on every linear layer of ``encoder``, in place; what was done, for the console and the manifest."""
    linears = [m for m in encoder.modules() if isinstance(m, nn.Linear)]
    if scheme != "fp32":
        quantize_linears(encoder, linears, scheme, group_size)
    return f"{scheme} on its {len(linears)} linear layers"

