"""Quantization schemes: the names ``conf/quant/*.yaml`` uses, mapped to torchao's integer formats and dtypes.

Three independent choices: the dtype of everything left in floating point, the scheme of the linear layers
(``lm_head`` may have its own), and the scheme of the token embedding. How they are applied is
``exporters.quant.apply``; which layer gets which group size is decided here (:func:`layer_scheme`); how the
integer codes and scales are chosen is ``quant.algorithm`` (:data:`DATA_FREE` here, or calibrated:
``exporters.quant.calibrated``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from exporters.config import Algorithm, DType
from exporters.errors import UserError, check_choice, listed
from exporters.quant.calibration import check_calibration
from exporters.quant.gptq import IntGrid

if TYPE_CHECKING:
    from exporters.config import BackendConfig, QuantConfig

# Both derived from the closed sets of the schema (exporters.config), where each value is defined once.
DTYPES: dict[str, torch.dtype] = {str(d): d.torch_dtype for d in DType}
# Algorithms that choose scales from the weights alone (``quant.algorithm``): torchao's IntxChooseQParamsAlgorithm
# values. The others need a calibration text (exporters.quant.calibrated).
DATA_FREE: dict[str, str] = {str(a): a.torchao_name for a in Algorithm if a.torchao_name is not None}
# Group sizes a layer may fall back to must be multiples of this (XNNPACK's blockwise kernels need it;
# its 4-bit kernels treat one scale per row as one group of the whole width, so that width too).
GROUP_SIZE_QUANTUM = 32
# 4-bit schemes whose kernels cannot take a layer of this width at all fall back to their 8-bit form.
EIGHT_BIT_FORM = {"8da4w": "8da8w", "4w": "8w"}


@dataclass(frozen=True)
class IntScheme:
    """One integer format: ``bits``-bit symmetric weights (torchao's ``IntxUnpackedToInt8Tensor``), with int8
    activations quantized per token at run time (``dynamic_activations``, XNNPACK's 8da kernels) or not."""

    bits: int
    dynamic_activations: bool

    @property
    def weight_dtype(self) -> torch.dtype:
        return getattr(torch, f"int{self.bits}")

    def grid(self, group_size: int) -> IntGrid:
        return IntGrid(-(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1, group_size)

    def torchao_config(self, group_size: int, algorithm: str) -> Any:
        """The torchao config that quantizes a module this way, its scales chosen by a data-free ``algorithm``, or
        given (a calibrated one: torchao's ``intx_choose_qparams_algorithm=None``, custom scales)."""
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerAxis, PerGroup

        granularity = PerAxis(0) if group_size == 0 else PerGroup(group_size)
        if self.dynamic_activations:
            return Int8DynamicActivationIntxWeightConfig(weight_dtype=self.weight_dtype, weight_granularity=granularity,
                                                         intx_choose_qparams_algorithm=DATA_FREE.get(algorithm))
        return IntxWeightOnlyConfig(weight_dtype=self.weight_dtype, granularity=granularity,
                                    intx_choose_qparams_algorithm=DATA_FREE.get(algorithm))

    def weight(self, codes: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
        """The torchao weight tensor holding given ``codes`` [rows, cols] and ``scales`` [rows, groups]: what
        torchao's own config would have made, with these values (so capture and lowering are unchanged)."""
        from torchao.quantization import IntxUnpackedToInt8Tensor

        return IntxUnpackedToInt8Tensor(
            qdata=codes, scale=scales.to(dtype), zero_point=torch.zeros_like(scales, dtype=torch.int8),
            target_dtype=self.weight_dtype, block_size=(1, group_size or codes.shape[1]), dtype=dtype,
            activation_quantization="int8_asym_per_token" if self.dynamic_activations else None)


LINEAR_SCHEMES: dict[str, IntScheme] = {
    "8da4w": IntScheme(bits=4, dynamic_activations=True),
    "8da8w": IntScheme(bits=8, dynamic_activations=True),
    "4w": IntScheme(bits=4, dynamic_activations=False),
    "8w": IntScheme(bits=8, dynamic_activations=False),
}
EMBEDDING_SCHEMES: dict[str, IntScheme] = {name: LINEAR_SCHEMES[name] for name in ("4w", "8w")}


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
    """The schemes are known, the group sizes make sense, the algorithms fit what they quantize, and
    ``backend``'s kernels run every part of it."""
    for role, value, table in (("linear", quant.linear, LINEAR_SCHEMES), ("lm_head", quant.lm_head, LINEAR_SCHEMES),
                               ("embedding", quant.embedding, EMBEDDING_SCHEMES),
                               ("adapters", quant.adapters, LINEAR_SCHEMES)):
        check_choice(f"quant.{role}", value, [None, *sorted(table)], f"Set quant.{role} to one of those.")
    for name in ("group_size", "lm_head_group_size", "embedding_group_size"):
        if getattr(quant, name) < 0:
            raise UserError(f"quant.{name}={getattr(quant, name)}: use 0 (per channel) or a positive group size.")
    check_algorithms(quant)
    check_activation_dtype(quant)
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


def check_activation_dtype(quant: QuantConfig) -> None:
    """Int8 dynamic activations (the 8da schemes) computed from bf16 have no ExecuTorch kernel: XNNPACK does not take
    torchao's bf16 choose/quantize/dequantize ops and the portable library has no out variant for them, so emit
    would fail after lowering (fp16 and fp32 are delegated)."""
    dynamic = sorted({s for s in (quant.linear, quant.lm_head, quant.adapters)
                      if s in LINEAR_SCHEMES and LINEAR_SCHEMES[s].dynamic_activations})
    if quant.dtype == DType.bf16 and dynamic:
        raise UserError(f"quant={quant.name} with quant.dtype=bf16 quantizes activations to int8 at run time "
                        f"({listed(dynamic)}) from bf16, which no ExecuTorch kernel runs (the program could not be "
                        f"emitted). Use quant.dtype=fp32 (the default) or fp16 with it, or quant=bf16 (no integer "
                        f"linears).")


def check_algorithms(quant: QuantConfig) -> None:
    """A calibrated ``quant.algorithm`` has integer linears to calibrate and a usable text; the embedding's is
    data-free (a lookup table has no inputs to calibrate with)."""

    if quant.embedding_algorithm not in DATA_FREE:
        raise UserError(
            f"quant.embedding_algorithm={quant.embedding_algorithm}: the token embedding is a lookup table, with no "
            f"inputs a calibration could weigh its rounding by. Use one of {listed(sorted(DATA_FREE))} "
            f"(quant.algorithm={quant.embedding_algorithm} calibrates the linear layers and lm_head).")
    if quant.size_budget is not None:
        check_size_budget(quant)
    if quant.algorithm not in DATA_FREE and not (quant.linear or quant.lm_head):
        raise UserError(
            f"quant.algorithm={quant.algorithm} calibrates integer weights, and quant={quant.name} has none in its "
            f"linear layers or lm_head (quant.linear and quant.lm_head are null). Pick an integer scheme "
            f"(quant=8da4w_calibrated, quant.linear=8da4w) or a data-free algorithm ({listed(sorted(DATA_FREE))}).")
    if quant.algorithm not in DATA_FREE or quant.size_budget is not None:  # both read the calibration text
        check_calibration(quant.calibration)
    check_learning(quant)


def check_learning(quant: QuantConfig) -> None:
    """``quant.learning`` is read by a learned algorithm only, and its values can be learned with."""
    learned = (Algorithm.distill, Algorithm.signround)
    set_ = {k: v for k, v in (("steps", quant.learning.steps), ("lr", quant.learning.lr),
                              ("rounding", quant.learning.rounding or None)) if v is not None}
    if set_ and quant.algorithm not in learned:
        named = ", ".join(f"quant.learning.{k}={v}" for k, v in set_.items())
        raise UserError(f"{named}: only quant.algorithm=distill and signround learn, and quant={quant.name} uses "
                        f"quant.algorithm={quant.algorithm}. Add quant.algorithm=distill (or quant=8da4w_learned), "
                        f"or drop the quant.learning settings.")
    if quant.learning.rounding and quant.algorithm != Algorithm.signround:
        raise UserError(f"quant.learning.rounding=true: only quant.algorithm=signround learns each weight's rounding; "
                        f"quant.algorithm={quant.algorithm} learns the group scales of GPTQ's codes. Drop "
                        f"quant.learning.rounding, or use quant.algorithm=signround.")
    if quant.learning.steps is not None and quant.learning.steps < 1:
        raise UserError(f"quant.learning.steps={quant.learning.steps}: learning needs at least one step "
                        f"(null = the algorithm's default).")
    top = 0.5 if quant.algorithm == Algorithm.signround else 0.1
    if quant.learning.lr is not None and not 0 < quant.learning.lr <= top:
        what = ("a signed step moves each scale factor (and rounding offset) by lr, and they live in ranges one wide"
                if quant.algorithm == Algorithm.signround else
                "Adam moves the log of each group scale by about lr a step; past 0.1 the first steps undo GPTQ's scales")
        raise UserError(f"quant.learning.lr={quant.learning.lr}: {what}; use a value in (0, {top}] (null = the "
                        f"algorithm's default).")


def check_size_budget(quant: QuantConfig) -> None:
    """A size budget can be spent: it is not below the uniform program, and some layer has a 4-bit scheme that
    8 bits can replace."""
    budget = quant.size_budget
    assert budget is not None
    if budget < 1.0:
        raise UserError(
            f"quant.size_budget={budget}: the budget is a multiple of quant={quant.name}'s uniform size, and the "
            f"smallest program it can make is the uniform one (1.0): mixed precision only gives layers more bits. "
            f"Use a value >= 1.0 (e.g. 1.05), or a smaller scheme (quant.group_size, quant.embedding=4w).")
    if not any(scheme in EIGHT_BIT_FORM for scheme in (quant.linear, quant.lm_head)):
        raise UserError(
            f"quant.size_budget={budget} gives 4-bit linear layers 8 bits where it helps most, and quant={quant.name} "
            f"has no 4-bit linears (linear {quant.linear}, lm_head {quant.lm_head}; 4-bit schemes: "
            f"{listed(sorted(EIGHT_BIT_FORM))}). Use quant=8da4w or quant=4w with it, or drop quant.size_budget.")
