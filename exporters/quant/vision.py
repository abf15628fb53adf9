"""``quant.vision``: the scheme a vision encoder's linear layers get, apart from the decoder's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from exporters.quant.linears import quantize_linears

if TYPE_CHECKING:
    from models.vision_encoder import VisionEncoder

# quant.vision: fp32; fp16 (computed in half precision, its output cast back to the text decoder's dtype); 8da8w
# (int8 weights per channel, int8 activations per token at run time); 8da4w (int4 weights in groups of
# quant.group_size, int8 activations per token).
VISION_SCHEMES = ("fp32", "fp16", "8da8w", "8da4w")
# quant.vision=auto: the scheme beside a decoder whose linear layers are quantized (chosen by measurement:
# docs/vision.md), and beside a float one.
AUTO, AUTO_QUANTIZED, AUTO_FLOAT = "auto", "8da8w", "fp32"


def vision_scheme(quant: Any) -> str:
    """The scheme ``quant.vision`` gives the vision encoder (``auto`` resolved by the decoder's linear scheme)."""
    if quant.vision != AUTO:
        return quant.vision
    return AUTO_QUANTIZED if quant.linear else AUTO_FLOAT


def quantize_vision(encoder: "VisionEncoder", scheme: str, group_size: int, out_dtype: torch.dtype) -> str:
    """``quant.vision`` applied to the encoder in place (its linear layers; the patch convolution and the norms stay
    in float); returns what was done, for the console and the manifest."""
    from torch import nn

    encoder.out_dtype = out_dtype
    if scheme == "fp32":
        return "fp32"
    if scheme == "fp16":
        encoder.to(torch.float16)
        encoder.compute_dtype = torch.float16
        return "fp16 (its output cast to the text decoder's dtype)"
    linears = [m for m in encoder.modules() if isinstance(m, nn.Linear)]
    quantize_linears(encoder, linears, scheme, group_size)
    return f"{scheme} on its {len(linears)} linear layers"
