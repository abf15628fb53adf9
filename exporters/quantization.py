"""Quantization schemes: names used in ``conf/quant/*.yaml`` mapped to torchao configs and dtypes.

Applied to the eager model with torchao's ``quantize_`` before capture (a source transform), so the
quantized eager model is also the reference the runtime output is validated against. Three
independent choices: the dtype of everything left in floating point, the scheme of the linear
layers (``lm_head`` may have its own), and the scheme of the token embedding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Callable

import torch
from torch import nn

from exporters.errors import UserError

TorchaoConfigFactory = Callable[[int], Any]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LINEAR_SCHEMES: dict[str, TorchaoConfigFactory] = {}
EMBEDDING_SCHEMES: dict[str, TorchaoConfigFactory] = {}


def _register(table: dict[str, TorchaoConfigFactory], name: str) -> Callable[[TorchaoConfigFactory], TorchaoConfigFactory]:
    def wrap(fn: TorchaoConfigFactory) -> TorchaoConfigFactory:
        table[name] = fn
        return fn

    return wrap


def _granularity(group_size: int) -> Any:
    from torchao.quantization.granularity import PerAxis, PerGroup

    return PerAxis(0) if group_size == 0 else PerGroup(group_size)


def _dynamic_activation(weight_dtype: torch.dtype, group_size: int) -> Any:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig

    return Int8DynamicActivationIntxWeightConfig(weight_dtype=weight_dtype, weight_granularity=_granularity(group_size))


def _weight_only(weight_dtype: torch.dtype, group_size: int) -> Any:
    from torchao.quantization import IntxWeightOnlyConfig

    return IntxWeightOnlyConfig(weight_dtype=weight_dtype, granularity=_granularity(group_size))


@_register(LINEAR_SCHEMES, "8da4w")
def int8_dynamic_act_int4_weight(group_size: int) -> Any:
    return _dynamic_activation(torch.int4, group_size)


@_register(LINEAR_SCHEMES, "8da8w")
def int8_dynamic_act_int8_weight(group_size: int) -> Any:
    return _dynamic_activation(torch.int8, group_size)


@_register(LINEAR_SCHEMES, "4w")
@_register(EMBEDDING_SCHEMES, "4w")
def int4_weight_only(group_size: int) -> Any:
    return _weight_only(torch.int4, group_size)


@_register(LINEAR_SCHEMES, "8w")
@_register(EMBEDDING_SCHEMES, "8w")
def int8_weight_only(group_size: int) -> Any:
    return _weight_only(torch.int8, group_size)


@dataclass
class AppliedScheme:
    scheme: str
    torchao_config: str
    torchao_args: dict[str, Any]
    layers: list[str]


@dataclass
class AppliedQuantization:
    """Exactly what was done to the model, for the manifest."""

    dtype: str = "fp32"
    linear: AppliedScheme | None = None
    lm_head: AppliedScheme | None = None
    embedding: AppliedScheme | None = None
    untied_embeddings: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def linear_scheme(self) -> str | None:
        return self.linear.scheme if self.linear else None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        parts = [self.dtype]
        for role in ("linear", "lm_head", "embedding"):
            applied = getattr(self, role)
            if applied:
                parts.append(f"{role} {applied.scheme} ({len(applied.layers)} layers)")
        return ", ".join(parts) + (", embeddings untied" if self.untied_embeddings else "")


def _describe(config: Any) -> dict[str, Any]:
    fields = asdict(config) if is_dataclass(config) else dict(vars(config))
    return {k: v if isinstance(v, (int, float, bool, str, type(None))) else str(v) for k, v in fields.items()}


def _check_group_size(modules: dict[str, nn.Module], group_size: int, width: Callable[[nn.Module], int],
                      field_name: str) -> None:
    if not group_size:
        return
    bad = {name: width(m) for name, m in modules.items() if width(m) % group_size}
    if bad:
        name, w = next(iter(bad.items()))
        widths = sorted({width(m) for m in modules.values()})
        raise UserError(
            f"{field_name}={group_size} does not divide the quantized width of {len(bad)} layer(s), e.g. {name} "
            f"({w}). Widths in this model: {widths}. Use a group size that divides all of them (e.g. "
            f"{field_name}=32) or {field_name}=0 for one scale per row."
        )


def _apply(model: nn.Module, table: dict[str, TorchaoConfigFactory], scheme: str, group_size: int,
           modules: dict[str, nn.Module], width: Callable[[nn.Module], int], field_name: str) -> AppliedScheme:
    from torchao.quantization import quantize_

    _check_group_size(modules, group_size, width, field_name)
    config = table[scheme](group_size)
    targets = set(modules.values())
    quantize_(model, config, filter_fn=lambda m, fqn: m in targets)
    return AppliedScheme(scheme, type(config).__name__, _describe(config), sorted(modules))


def quantize_model(model: nn.Module, dtype: str, linear: str | None, group_size: int,
                   lm_head: str | None, lm_head_group_size: int,
                   embedding: str | None, embedding_group_size: int) -> AppliedQuantization:
    """Cast to ``dtype`` then quantize linears, ``lm_head`` and the embedding in place.

    The checkpoint's own dtype (often bf16) is kept through loading, so this cast is the only point
    where a second copy of the weights can exist.
    """
    if any(p.dtype != DTYPES[dtype] for p in model.parameters()):
        model.to(DTYPES[dtype])
        model.init_buffers()  # KV caches in the model's dtype (fp32 where the attention kernels need it)
    applied = AppliedQuantization(dtype=dtype)
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = head is not None and embed is not None and head.weight is embed.weight
    if tied and (lm_head, lm_head_group_size) != (embedding, embedding_group_size):
        # The shared matrix cannot be stored two ways at once: give lm_head its own copy first.
        head.weight = nn.Parameter(embed.weight.detach().clone())
        applied.untied_embeddings = True
        applied.notes.append(
            f"tied embedding untied: lm_head quantized as {lm_head or dtype}, embedding as {embedding or dtype}"
        )
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    if embedding:
        applied.embedding = _apply(model, EMBEDDING_SCHEMES, embedding, embedding_group_size,
                                   {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding)},
                                   lambda m: m.embedding_dim, "quant.embedding_group_size")
        if tied and not applied.untied_embeddings:
            head.weight = embed.weight  # one quantized tensor serves both
            applied.notes.append(f"tied embedding kept tied: both quantized as {embedding}")
    if linear and linears:
        applied.linear = _apply(model, LINEAR_SCHEMES, linear, group_size, linears, lambda m: m.in_features,
                                "quant.group_size")
    if lm_head and head is not None and not (tied and not applied.untied_embeddings):
        applied.lm_head = _apply(model, LINEAR_SCHEMES, lm_head, lm_head_group_size, {"lm_head": head},
                                 lambda m: m.in_features, "quant.lm_head_group_size")
    return applied
