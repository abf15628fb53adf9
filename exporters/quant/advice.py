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
from exporters.quant.calibration import CalibrationText, layer_by_layer_blocker
from exporters.quant.remedy_cache import Measurement, RemedyCache
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


@dataclass(frozen=True)
class Loss:
    """The quality the export lost, which the warning is about."""

    threshold: float  # validation.warn_ppl_increase
    ppl_increase: float  # the program's perplexity over the unquantized model's, minus 1
    eager_perplexity: float  # the export's eager quantized model
    baseline_perplexity: float  # the unquantized model


#: GPTQ's quantization against the data-free one's (HQQ) on the same model: a remedy that calibrates is estimated at
#: this many times the export's own quantize stage. SmolLM2-135M on 2026-11-29, the quantize stage of quant=8da4w
#: 5.0 and 6.5 s around quant=8da4w_calibrated's 92.3 s (run_stages up to quantize, one process).
CALIBRATED_SLOWER = 16.0


@dataclass(frozen=True)
class StageSeconds:
    """What this export's own stages took, from which a remedy's time is estimated before it starts: a fresh model
    is built as load built one, quantized as quantize did, and scored as baseline scored the unquantized model."""

    load: float
    quantize: float
    baseline: float

    def remedy(self, change: Change) -> float:
        return self.load + self.quantize * (CALIBRATED_SLOWER if change.casts_whole else 1.0) + self.baseline


@dataclass(frozen=True)
class Trials:
    """How advise makes and scores each fresh model, what that is estimated to take, and where earlier measurements
    of the same model, text and config are kept."""

    build: Callable[[], CausalLM]  # the model as load built it
    score: Callable[[CausalLM], float]  # its perplexity on the validation windows
    calibration: Callable[[CausalLM], Callable[[], CalibrationText]]  # the text GPTQ reads, for that model
    seconds: StageSeconds
    cache: RemedyCache | None = None


def _blocker(change: Change, model: CausalLM, whole_does_not_fit: str | None) -> str | None:
    """Why ``change`` is not measured on ``model``, or None: the memory estimate says it would not fit, or what it
    runs is not implemented for the model (rotations and layer-by-layer calibration of Gemma 4)."""
    if change.casts_whole and whole_does_not_fit is not None:
        return whole_does_not_fit
    if change.rotates and model.args.per_layer_shapes:
        return "rotations are not implemented for a model whose layers differ in shape"
    if change.fields.get("algorithm") == Algorithm.gptq:
        blocker = layer_by_layer_blocker(model)
        return None if blocker is None else f"GPTQ is not implemented for this model: {blocker}"
    return None


def advise(plan: QuantPlan, loss: Loss, quantized: CausalLM, trials: Trials,
           whole_does_not_fit: str | None = None) -> QualityWarning:
    """Each remedy of ``plan``'s quant config measured on a fresh model from ``trials``: quantized as the export was
    (the same tied-embedding storage), scored, and weighed against ``quantized`` (the export's eager model).
    ``whole_does_not_fit``: why the remedies that hold the model whole are not measured (the memory estimate says
    they would not fit), else None."""
    started = time.perf_counter()
    found, unmeasured = [], {}
    remedies = changes(plan.config)
    known = {c.overrides: trials.cache.get(_config(plan, c)) if trials.cache else None for c in remedies}
    blocked = {c.overrides: _blocker(c, quantized, whole_does_not_fit) for c in remedies}
    to_measure = [c for c in remedies if known[c.overrides] is None and blocked[c.overrides] is None]
    if remedies:
        earlier = sum(m is not None for m in known.values())
        log.info("  advise: perplexity %+.1f%% over unquantized; %d remedies to measure, about %.0f s (estimated)%s; "
                 "validation.warn_ppl_increase=null turns the warning and its measurements off",
                 100 * loss.ppl_increase, len(to_measure), sum(trials.seconds.remedy(c) for c in to_measure),
                 f", {earlier} read from an earlier measurement of this model" if earlier else "")
    own_bytes = stored_bytes(quantized)
    for i, change in enumerate(remedies, start=1):
        measured = known[change.overrides]
        if measured is not None:
            log.info("  advise: remedy %d/%d, %s (%s): measured before (%.0f s then)", i, len(remedies), change.what,
                     change.overrides, measured.seconds)
        elif blocked[change.overrides] is not None:
            log.warning("  advise: remedy %d/%d, %s (%s), not measured: %s", i, len(remedies), change.what,
                        change.overrides, blocked[change.overrides])
            unmeasured[change.overrides] = blocked[change.overrides]
            continue
        else:
            log.info("  advise: remedy %d/%d, %s (%s): a fresh copy of the model, quantized and scored (about %.0f s)",
                     i, len(remedies), change.what, change.overrides, trials.seconds.remedy(change))
            measured = _measure(plan, change, trials)
        found.append(_remedy(change, measured, loss, own_bytes))
    # Free ones first (by what they recover), then the most recovered per MB.
    found.sort(key=lambda r: (r.extra_mb > 0.01, -(r.recovered if r.extra_mb <= 0.01 else r.recovered / r.extra_mb)))
    return QualityWarning(threshold=loss.threshold, ppl_increase=round(loss.ppl_increase, 4), remedies=found,
                          seconds=round(time.perf_counter() - started, 1), unmeasured=unmeasured)


def _config(plan: QuantPlan, change: Change) -> QuantConfig:
    return dataclasses.replace(plan.config, **change.fields)


def _measure(plan: QuantPlan, change: Change, trials: Trials) -> Measurement:
    """``change`` applied to a fresh model: its perplexity and its weights' bytes (kept for the next export of the
    same model, text and config)."""
    started = time.perf_counter()
    model = trials.build()
    with progress_as(f"advise, {change.what}"):
        quantize_model(model, _config(plan, change), plan.tied_storage, calibration=trials.calibration(model),
                       shortcuts=plan.shortcuts)
    measured = Measurement(perplexity=round(trials.score(model), 4), stored_bytes=stored_bytes(model),
                           seconds=round(time.perf_counter() - started, 1))
    del model
    return_freed_memory()  # else each remedy's freed heap stays under the next one's peak
    if trials.cache is not None:
        trials.cache.put(_config(plan, change), measured)
    return measured


def _remedy(change: Change, measured: Measurement, loss: Loss, own_bytes: int) -> Remedy:
    """The share of the loss ``measured`` wins back and the bytes it adds over the export's own model."""
    lost = loss.eager_perplexity - loss.baseline_perplexity
    return Remedy(change=change.overrides, what=change.what, perplexity=measured.perplexity,
                  recovered=round((loss.eager_perplexity - measured.perplexity) / lost, 4) if lost > 0 else 0.0,
                  extra_mb=round((measured.stored_bytes - own_bytes) / MB, 3))
