"""Quantization schemes: names used in ``conf/quant/*.yaml`` mapped to torchao configs.

Applied to the eager model with torchao's ``quantize_`` before capture (a source transform), so the
quantized eager model is also the reference the runtime output is validated against.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Callable

import torch
from torch import nn

from exporters.errors import UserError

TorchaoConfigFactory = Callable[[int], Any]

LINEAR_SCHEMES: dict[str, TorchaoConfigFactory] = {}


def register_linear(name: str) -> Callable[[TorchaoConfigFactory], TorchaoConfigFactory]:
    def wrap(fn: TorchaoConfigFactory) -> TorchaoConfigFactory:
        LINEAR_SCHEMES[name] = fn
        return fn

    return wrap


def _granularity(group_size: int) -> Any:
    from torchao.quantization.granularity import PerAxis, PerGroup

    return PerAxis(0) if group_size == 0 else PerGroup(group_size)


@register_linear("8da4w")
def int8_dynamic_act_int4_weight(group_size: int) -> Any:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig

    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=_granularity(group_size))


@register_linear("8da8w")
def int8_dynamic_act_int8_weight(group_size: int) -> Any:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig

    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=_granularity(group_size))


@dataclass
class AppliedQuantization:
    """Exactly what was done to the model, for the manifest."""

    linear_scheme: str | None
    torchao_config: str | None
    torchao_args: dict[str, Any]
    layers: list[str]
    untied_embeddings: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _describe(config: Any) -> dict[str, Any]:
    fields = asdict(config) if is_dataclass(config) else dict(vars(config))
    return {k: str(v) if not isinstance(v, (int, float, bool, str, type(None))) else v for k, v in fields.items()}


def quantize_linears(model: nn.Module, scheme: str | None, group_size: int) -> AppliedQuantization:
    """Quantize every ``nn.Linear`` (including ``lm_head``) in place with ``scheme``."""
    if scheme is None:
        return AppliedQuantization(None, None, {}, [], False)
    from torchao.quantization import quantize_

    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if group_size:
        bad = {name: m.in_features for name, m in linears.items() if m.in_features % group_size}
        if bad:
            name, width = next(iter(bad.items()))
            dims = sorted({m.in_features for m in linears.values()})
            raise UserError(
                f"quant.group_size={group_size} does not divide the input width of {len(bad)} linear layer(s), "
                f"e.g. {name} ({width}). Input widths in this model: {dims}. Use a group size that divides all "
                "of them (e.g. quant.group_size=32) or quant.group_size=0 for per-channel scales."
            )
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    was_tied = lm_head is not None and embed is not None and lm_head.weight is embed.weight
    config = LINEAR_SCHEMES[scheme](group_size)
    quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    untied = was_tied and lm_head.weight is not embed.weight
    return AppliedQuantization(
        linear_scheme=scheme,
        torchao_config=type(config).__name__,
        torchao_args=_describe(config),
        layers=sorted(linears),
        untied_embeddings=untied,
    )
