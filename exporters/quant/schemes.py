"""Quantization schemes: the names ``conf/quant/*.yaml`` uses, mapped to torchao configs and dtypes.

Three independent choices: the dtype of everything left in floating point, the scheme of the linear layers
(``lm_head`` may have its own), and the scheme of the token embedding. How they are applied is
``exporters.quant.apply``; which layer gets which group size is decided here (:func:`layer_scheme`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from exporters.errors import UserError, check_choice, listed

if TYPE_CHECKING:
    from exporters.config import BackendConfig, QuantConfig

TorchaoConfigFactory = Callable[[int, str], Any]  # (group size, torchao qparams algorithm) -> config

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LINEAR_SCHEMES: dict[str, TorchaoConfigFactory] = {}
EMBEDDING_SCHEMES: dict[str, TorchaoConfigFactory] = {}
# How integer scales are chosen (``quant.qparams``, exporters.config.QParams): torchao's
# IntxChooseQParamsAlgorithm values.
QPARAMS: dict[str, str] = {"hqq": "hqq_scale_only", "affine": "affine"}
# Group sizes a layer may fall back to must be multiples of this (XNNPACK's blockwise kernels need it;
# its 4-bit kernels treat one scale per row as one group of the whole width, so that width too).
GROUP_SIZE_QUANTUM = 32
# 4-bit schemes whose kernels cannot take a layer of this width at all fall back to their 8-bit form.
EIGHT_BIT_FORM = {"8da4w": "8da8w", "4w": "8w"}


def _register(table: dict[str, TorchaoConfigFactory], name: str) -> Callable[[TorchaoConfigFactory], TorchaoConfigFactory]:
    def wrap(fn: TorchaoConfigFactory) -> TorchaoConfigFactory:
        table[name] = fn
        return fn

    return wrap


def _granularity(group_size: int) -> Any:
    from torchao.quantization.granularity import PerAxis, PerGroup

    return PerAxis(0) if group_size == 0 else PerGroup(group_size)


def _dynamic_activation(weight_dtype: torch.dtype, group_size: int, algorithm: str) -> Any:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig

    return Int8DynamicActivationIntxWeightConfig(weight_dtype=weight_dtype, weight_granularity=_granularity(group_size),
                                                 intx_choose_qparams_algorithm=algorithm)


def _weight_only(weight_dtype: torch.dtype, group_size: int, algorithm: str) -> Any:
    from torchao.quantization import IntxWeightOnlyConfig

    return IntxWeightOnlyConfig(weight_dtype=weight_dtype, granularity=_granularity(group_size),
                                intx_choose_qparams_algorithm=algorithm)


@_register(LINEAR_SCHEMES, "8da4w")
def int8_dynamic_act_int4_weight(group_size: int, algorithm: str) -> Any:
    return _dynamic_activation(torch.int4, group_size, algorithm)


@_register(LINEAR_SCHEMES, "8da8w")
def int8_dynamic_act_int8_weight(group_size: int, algorithm: str) -> Any:
    return _dynamic_activation(torch.int8, group_size, algorithm)


@_register(LINEAR_SCHEMES, "4w")
@_register(EMBEDDING_SCHEMES, "4w")
def int4_weight_only(group_size: int, algorithm: str) -> Any:
    return _weight_only(torch.int4, group_size, algorithm)


@_register(LINEAR_SCHEMES, "8w")
@_register(EMBEDDING_SCHEMES, "8w")
def int8_weight_only(group_size: int, algorithm: str) -> Any:
    return _weight_only(torch.int8, group_size, algorithm)


def group_size_for(width: int, requested: int) -> int:
    """``requested`` if it divides ``width``; else the largest smaller multiple of 32 that does; else 0 (per row)."""
    if requested == 0 or width % requested == 0:
        return requested
    fallbacks = range(requested - requested % GROUP_SIZE_QUANTUM, 0, -GROUP_SIZE_QUANTUM)
    return next((g for g in fallbacks if g < requested and width % g == 0), 0)


def layer_scheme(scheme: str, width: int, requested: int) -> tuple[str, int]:
    """The scheme and group size a layer of ``width`` gets: the nearest to what was asked that kernels run."""
    group = group_size_for(width, requested)
    if group == 0 and width % GROUP_SIZE_QUANTUM and scheme in EIGHT_BIT_FORM:
        return EIGHT_BIT_FORM[scheme], 0
    return scheme, group


def describe_choice(scheme: str, group: int) -> str:
    return f"{scheme}, " + ("one scale per row" if group == 0 else f"group size {group}")


def check_quant(quant: QuantConfig, backend: BackendConfig) -> None:
    """The schemes are known, the group sizes make sense, and ``backend``'s kernels run every part of it."""
    for role, value, table in (("linear", quant.linear, LINEAR_SCHEMES), ("lm_head", quant.lm_head, LINEAR_SCHEMES),
                               ("embedding", quant.embedding, EMBEDDING_SCHEMES),
                               ("adapters", quant.adapters, LINEAR_SCHEMES)):
        check_choice(f"quant.{role}", value, [None, *sorted(table)], f"Set quant.{role} to one of those.")
    for name in ("group_size", "lm_head_group_size", "embedding_group_size"):
        if getattr(quant, name) < 0:
            raise UserError(f"quant.{name}={getattr(quant, name)}: use 0 (per channel) or a positive group size.")
    b = backend
    wanted = (("dtype", quant.dtype, b.supported_dtypes), ("linear", quant.linear, b.supported_linear),
              ("lm_head", quant.lm_head, b.supported_linear), ("embedding", quant.embedding, b.supported_embedding),
              ("adapters", quant.adapters, b.supported_linear))
    for role, value, supported in wanted:
        if value not in supported:
            raise UserError(
                f"quant={quant.name} asks for {role} {value or 'none'}, which backend={b.name} cannot run. "
                f"backend={b.name} supports dtypes {listed(b.supported_dtypes)}; linear/lm_head schemes "
                f"{listed(b.supported_linear)}; embedding schemes {listed(b.supported_embedding)}. "
                f"Pick another quant or backend, or override quant.{role}."
            )
