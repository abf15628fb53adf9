"""One integer scheme on a chosen set of linear layers: what an encoder beside the decoder gets (``quant.vision``,
``quant.audio``), with each layer's group size the nearest its kernels take (``exporters.quant.schemes``)."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from exporters.quant.schemes import LINEAR_SCHEMES, layer_scheme


def quantize_linears(root: nn.Module, linears: Sequence[nn.Linear], scheme: str, group_size: int) -> None:
    """``scheme`` (a key of LINEAR_SCHEMES) applied in place to ``linears``, modules of ``root``; scales by HQQ.
    8-bit schemes take one scale per row (XNNPACK's 8-bit kernels), 4-bit ones groups of ``group_size``."""
    from torchao.quantization import quantize_  # torchao's quantizers: imported when an encoder is quantized

    requested = group_size if LINEAR_SCHEMES[scheme].bits == 4 else 0
    by_choice: dict[tuple[str, int], set[int]] = {}  # one quantize_ walk per (scheme, group size) the layers get
    for layer in linears:
        by_choice.setdefault(layer_scheme(scheme, layer.in_features, requested), set()).add(id(layer))
    for (chosen, group), layers in by_choice.items():
        quantize_(root, LINEAR_SCHEMES[chosen].torchao_config(group, "hqq"),
                  filter_fn=lambda m, fqn, layers=layers: id(m) in layers)
