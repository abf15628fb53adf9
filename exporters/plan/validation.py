"""How an export is validated, decided once: the text's prompt length, the tolerance, which side runs where."""

from __future__ import annotations

from dataclasses import dataclass, field

from exporters.config import DType, KvCacheTolerance, KvDType, QuantConfig, ValidationConfig, quant_option

MANTISSA_BITS: dict[DType, int] = {DType.fp32: 23, DType.fp16: 10, DType.bf16: 7}


def coarser(runs_in: DType | None, dtype: DType) -> bool:
    """Whether the device computes in fewer mantissa bits than the program's ``dtype``."""
    return runs_in is not None and MANTISSA_BITS[runs_in] < MANTISSA_BITS[dtype]


@dataclass(frozen=True)
class Tolerance:
    """How far the program may be from the eager quantized model (``quant.max_kl`` .. ``quant.max_ppl_drift``)."""

    max_kl: float
    min_top1: float
    max_ppl_drift: float

    @staticmethod
    def of(quant: QuantConfig, runs_in: DType | None = None, kv: KvCacheTolerance | None = None) -> "Tolerance":
        """``quant``'s tolerance; where the delegate computes in a coarser dtype than the program's (``runs_in``,
        its device's choice), the looser of it and the tolerance calibrated for that dtype (``conf/quant/<dtype>``);
        with a quantized KV cache, plus what ``kv`` allows it (the reference keeps an fp32 cache)."""
        own = Tolerance(quant.max_kl, quant.min_top1, quant.max_ppl_drift)
        if coarser(runs_in, quant.dtype):
            floor = quant_option(str(runs_in))
            own = Tolerance(max(own.max_kl, floor.max_kl), min(own.min_top1, floor.min_top1),
                            max(own.max_ppl_drift, floor.max_ppl_drift))
        if kv is None:
            return own
        return Tolerance(own.max_kl + kv.max_kl, own.min_top1 - (1 - kv.min_top1), own.max_ppl_drift + kv.max_ppl_drift)


def prompt_length(requested: int, max_context_len: int, static_chunk: int | None) -> int:
    """Prompt tokens per window: at most half the context, so each window has tokens left to decode; on
    static-shape backends a whole number of prefill chunks (no padding)."""
    tokens = min(requested, max(1, max_context_len // 2))
    if static_chunk is None:
        return tokens
    return max(static_chunk, tokens - tokens % static_chunk)


@dataclass(frozen=True)
class ValidationPlan:
    """What the baseline, validate and advise stages do (present only with ``validate=true``)."""

    config: ValidationConfig  # the text, its token budget, the quality warning's threshold
    prompt_tokens: int  # of each window, through the prompt method
    tolerance: Tolerance
    runs_in: DType | None  # the device's coarser precision the tolerance allows for, else None
    in_runtime: bool  # the .pte runs in this host's runtime (else its undelegated programs stand in)
    eager_from_graphs: bool  # the eager side is the undelegated programs (PT2E: the model exists only as graphs)
    eager_kv_dtype: KvDType | None  # the eager side's cache when the program's is quantized (fp32), else None
    # The other components' methods (the draft's) against their own eager models, each by its own quant's tolerance.
    component_tolerance: dict[str, Tolerance] = field(default_factory=dict)

    @property
    def advise_threshold(self) -> float | None:
        return self.config.warn_ppl_increase
