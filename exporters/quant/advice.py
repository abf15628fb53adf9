"""When a scheme costs too much quality: measure, on this model, what would win it back and for how many bytes.

Validation says whether the program matches its eager quantized model; it passes just as well when that model
has lost half its quality. Past ``validation.warn_ppl_increase`` over the unquantized model, each applicable
change of the quant config (an 8-bit ``lm_head`` or embedding, GPTQ in place of a data-free algorithm, rotations
with GPTQ, groups of 32) is applied to a fresh copy of the model and scored on the same validation windows: the
share of the loss it recovers and the bytes it adds, best recovery per MB first. Measured, not guessed: which remedy works
differs by model (SmolLM2's ``lm_head`` is its most sensitive layer; another model's may be its embedding).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from exporters.config import Algorithm, QuantConfig, RotationKind
from exporters.manifest import QualityWarning, Remedy
from exporters.quant.apply import progress_as, quantize_model
from exporters.quant.calibration import CalibrationText
from exporters.quant.schemes import DATA_FREE, EIGHT_BIT_FORM, GROUP_SIZE_QUANTUM
from exporters.runtime.memory import return_freed_memory
from models.decoder import CausalLM

if TYPE_CHECKING:
    from exporters.quant.plan import QuantPlan

MB = 1e6

log = logging.getLogger("exporters")


@dataclass(frozen=True)
class Change:
    """One change to the quant config, as the command-line overrides that make it."""

    what: str
    fields: dict[str, Any]

    @property
    def rotates(self) -> bool:
        return "rotation" in self.fields

    @property
    def casts_whole(self) -> bool:
        """The remedy holds the model whole in its compute dtype (calibrating runs it, rotating turns it)."""
        return self.fields.get("algorithm") == Algorithm.gptq or self.rotates

    @property
    def overrides(self) -> str:
        return " ".join(f"quant.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.fields.items())


def changes(quant: QuantConfig) -> list[Change]:
    """The remedies that apply to ``quant``: each spends bytes (or calibration time) where 4-bit data-free
    rounding loses most."""
    found = []
    if quant.lm_head in EIGHT_BIT_FORM:
        found.append(Change("8-bit lm_head", {"lm_head": EIGHT_BIT_FORM[quant.lm_head], "lm_head_group_size": 0}))
    if quant.embedding in EIGHT_BIT_FORM:
        found.append(Change("8-bit embedding", {"embedding": EIGHT_BIT_FORM[quant.embedding]}))
    if quant.algorithm in DATA_FREE and (quant.linear or quant.lm_head):
        found.append(Change("GPTQ-calibrated linears", {"algorithm": Algorithm.gptq}))
    if quant.algorithm not in DATA_FREE and quant.linear in EIGHT_BIT_FORM and quant.rotation == RotationKind.none:
        # With data-free rounding a rotation wins nothing back at groups of 32 (docs/quality.md#rotations).
        found.append(Change("Hadamard rotations", {"rotation": RotationKind.hadamard, "online_hadamard": True}))
    if quant.linear in EIGHT_BIT_FORM and quant.group_size > GROUP_SIZE_QUANTUM:
        found.append(Change(f"groups of {GROUP_SIZE_QUANTUM}", {
            "group_size": GROUP_SIZE_QUANTUM,
            **({"lm_head_group_size": GROUP_SIZE_QUANTUM} if quant.lm_head_group_size == quant.group_size else {})}))
    return found


def stored_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct weights as the program stores them (integer codes at their bit width, and
    their scales)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        data = getattr(p, "data", p)
        if hasattr(data, "qdata") and hasattr(data, "target_dtype"):  # torchao's IntxUnpackedToInt8Tensor
            bits = int(str(data.target_dtype).removeprefix("torch.int"))
            total += data.qdata.numel() * bits // 8 + data.scale.numel() * data.scale.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def advise(plan: QuantPlan, threshold: float, ppl_increase: float, quantized: CausalLM,
           eager_perplexity: float, baseline_perplexity: float, build: Callable[[], CausalLM],
           score: Callable[[CausalLM], float],
           calibration: Callable[[CausalLM], Callable[[], CalibrationText]],
           whole_does_not_fit: str | None = None) -> QualityWarning:
    """Each remedy of ``plan``'s quant config measured on a fresh model from ``build``: quantized as the export was
    (the same tied-embedding storage), ``score``d (its perplexity on the validation windows) and weighed against
    ``quantized`` (the export's eager model, of perplexity ``eager_perplexity``). ``calibration(model)`` reads the
    text GPTQ needs. ``whole_does_not_fit``: why the remedies that hold the model whole are not measured (the memory
    estimate says they would not fit), else None."""
    started = time.perf_counter()
    quant = plan.config
    own_bytes = stored_bytes(quantized)
    loss = eager_perplexity - baseline_perplexity
    found, unmeasured = [], {}
    remedies = changes(quant)
    for i, change in enumerate(remedies, start=1):
        if change.casts_whole and whole_does_not_fit is not None:
            log.warning("  advise: remedy %d/%d, %s (%s), not measured: %s", i, len(remedies), change.what,
                        change.overrides, whole_does_not_fit)
            unmeasured[change.overrides] = whole_does_not_fit
            continue
        log.info("  advise: remedy %d/%d, %s (%s): a fresh copy of the model, quantized and scored", i, len(remedies),
                 change.what, change.overrides)
        variant = dataclasses.replace(quant, **change.fields)
        model = build()
        with progress_as(f"advise, {change.what}"):
            quantize_model(model, variant, plan.tied_storage, calibration=calibration(model), shortcuts=plan.shortcuts)
        perplexity = score(model)
        extra = stored_bytes(model) - own_bytes
        del model
        return_freed_memory()  # else each remedy's freed heap stays under the next one's peak
        found.append(Remedy(change=change.overrides, what=change.what, perplexity=round(perplexity, 4),
                            recovered=round((eager_perplexity - perplexity) / loss, 4) if loss > 0 else 0.0,
                            extra_mb=round(extra / MB, 3)))
    # Free ones first (by what they recover), then the most recovered per MB.
    found.sort(key=lambda r: (r.extra_mb > 0.01, -(r.recovered if r.extra_mb <= 0.01 else r.recovered / r.extra_mb)))
    return QualityWarning(threshold=threshold, ppl_increase=round(ppl_increase, 4), remedies=found,
                          seconds=round(time.perf_counter() - started, 1), unmeasured=unmeasured)
