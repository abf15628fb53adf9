"""Apply a quant config to the eager model: dtype cast, then torchao's ``quantize_`` on linears, embedding, lm_head.

A source transform before capture, so the quantized eager model is also what validation compares the program
with ("eager"). The model is changed in place: a copy would double the peak memory of the largest models.
"""

from __future__ import annotations

import contextlib
import contextvars

import logging
import time
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from exporters.config import Algorithm, QuantConfig, RotationKind, TiedEmbeddingStorage
from exporters.manifest import AppliedQuantization, AppliedScheme, CalibrationRecord, MixedPrecisionRecord
from exporters.quant import tied
from exporters.quant.calibrated import Target, quantize_calibrated
from exporters.quant.calibration import CalibrationText
from exporters.quant.hqq import hqq_by_rows
from exporters.quant.rotation import rotate, rotates
from exporters.quant import distill, learned_rotation, signround
from exporters.quant.signround import Learning, quantize_learned
from exporters.quant.mixed import (SENSITIVITY_TOKENS, Candidate, Precision, choose_upgrades, measure_sensitivity,
                                   weight_bytes)
from exporters.quant.schemes import (DATA_FREE, DTYPES, EIGHT_BIT_FORM, EMBEDDING_SCHEMES, LINEAR_SCHEMES, IntScheme,
                                     describe_choice, layer_scheme)
from models.decoder import CausalLM
from models.lora import is_adapter_module
from models.mapped_pages import release_file_pages

log = logging.getLogger("exporters")

# Progress lines while quantizing many layers (a 1B model's linears take a minute): one per this share.
PROGRESS_STEP = 0.25


def _describe(config: Any) -> dict[str, Any]:
    fields = asdict(config) if is_dataclass(config) else dict(vars(config))
    return {k: v if isinstance(v, (int, float, bool, str, type(None))) else str(v) for k, v in fields.items()}


#: What the progress lines say is quantizing: the quantize stage, or another stage quantizing a copy (advise).
PROGRESS_LABEL: contextvars.ContextVar[str] = contextvars.ContextVar("progress_label", default="quantize")


@contextlib.contextmanager
def progress_as(label: str) -> Iterator[None]:
    """Within this block, quantization's progress lines start with ``label`` instead of ``quantize``."""
    token = PROGRESS_LABEL.set(label)
    try:
        yield
    finally:
        PROGRESS_LABEL.reset(token)


def _progress(role: str, total: int) -> Callable[[], None]:
    """Called once per quantized layer; logs at every quarter of ``total`` when there are many layers."""
    done = 0
    label = PROGRESS_LABEL.get()
    marks = {max(1, round(total * k * PROGRESS_STEP)) for k in range(1, int(1 / PROGRESS_STEP))} if total >= 16 else set()

    def step() -> None:
        nonlocal done
        done += 1
        if done in marks:
            log.info("  %s: %s %d/%d matrices", label, role, done, total)

    return step


@dataclass
class RolePlan:
    """What one role's layers become: each module's (scheme, group size), and the manifest's record of it."""

    chosen: dict[str, tuple[str, int]]
    modules: dict[str, nn.Module]
    table: dict[str, IntScheme]
    record: AppliedScheme

    def precision(self, name: str) -> Precision:
        scheme, group = self.chosen[name]
        return Precision(scheme, self.table[scheme], group)


def _plan(table: dict[str, IntScheme], scheme: str, group_size: int, algorithm: str, modules: dict[str, nn.Module],
          width: Callable[[nn.Module], int], notes: list[str]) -> RolePlan:
    """Each layer's scheme and group size; a layer the group size does not fit gets the nearest choice that does."""
    chosen = {name: layer_scheme(scheme, width(m), group_size) for name, m in modules.items()}
    fallbacks = {n: describe_choice(*c) for n, c in sorted(chosen.items()) if c != (scheme, group_size)}
    for what in sorted(set(fallbacks.values())):
        names = [n for n, w in fallbacks.items() if w == what]
        note = (f"{scheme}: group size {group_size} does not divide the width of {len(names)} layer(s) "
                f"({names[0]}: {width(modules[names[0]])}); they use {what}")
        log.info(note)
        notes.append(note)
    config = table[scheme].torchao_config(group_size, algorithm)
    record = AppliedScheme(scheme, type(config).__name__, _describe(config),
                           {n: c[1] for n, c in sorted(chosen.items())}, fallbacks, algorithm=algorithm)
    return RolePlan(chosen, modules, table, record)


def _apply_data_free(role: str, plan: RolePlan, algorithm: str, dtype: torch.dtype, shortcuts: bool = True) -> None:
    """torchao's ``quantize_`` on the plan's modules one at a time, its scales chosen from the weights alone. Each is
    cast to ``dtype`` just before: only one layer is ever held in ``dtype`` beside the stored (often bf16) weights.
    ``shortcuts``: HQQ's scales chosen a block of rows at a time (exporters.quant.hqq; the same bits as torchao's)."""
    from torchao.quantization import quantize_

    step = _progress(role, len(plan.modules))
    configs = {choice: plan.table[choice[0]].torchao_config(choice[1], algorithm) for choice in set(plan.chosen.values())}
    with hqq_by_rows() if shortcuts else contextlib.nullcontext():
        for name, module in plan.modules.items():
            stored = [p.data for p in module.parameters(recurse=False)]
            module.to(dtype)
            quantize_(module, configs[plan.chosen[name]], filter_fn=lambda m, fqn, target=module: m is target)
            release_file_pages(stored)  # the checkpoint's pages of what was just replaced
            del stored
            step()


def quantize_linear_role(role: str, linears: dict[str, nn.Linear], scheme: str, group_size: int, algorithm: str,
                         dtype: torch.dtype, notes: list[str], shortcuts: bool = True) -> AppliedScheme:
    """``scheme`` on ``linears`` (name -> module) with scales chosen from the weights alone (``algorithm``: hqq or
    affine), each layer's group size the nearest its kernels take; the manifest's record of it. What a model other
    than our decoder uses for its linear layers (a speech model's)."""
    plan = _plan(LINEAR_SCHEMES, scheme, group_size, algorithm, linears, _in_features, notes)  # type: ignore[arg-type]
    _apply_data_free(role, plan, algorithm, dtype, shortcuts)
    return plan.record


def learning_steps(cfg: QuantConfig) -> int | None:
    """The steps a learned algorithm takes (per layer for signround, in all for distill; None for the others)."""
    defaults = {Algorithm.signround: signround.DEFAULT_STEPS, Algorithm.distill: distill.DEFAULT_STEPS}
    return cfg.learning.steps or defaults[cfg.algorithm] if cfg.algorithm in defaults else None


def _apply_calibrated(model: CausalLM, cfg: QuantConfig, plans: dict[str, RolePlan], text: CalibrationText
                      ) -> list[float]:
    """``cfg.algorithm`` (GPTQ, SignRound, GPTQ then distillation) on the calibration text for the plans' modules
    (the linears and lm_head); distillation's KL at each step (empty for the others)."""
    targets = {name: Target(module, plan.precision(name).integer, plan.precision(name).group_size)  # type: ignore[arg-type]
               for plan in plans.values() for name, module in plan.modules.items()}
    if cfg.algorithm == Algorithm.signround:
        learning = Learning(steps=learning_steps(cfg), lr=cfg.learning.lr, rounding=cfg.learning.rounding)
        log.info("  %s: learning each layer's scales%s, %d steps a layer", PROGRESS_LABEL.get(),
                 " and rounding" if learning.rounding else "", learning.steps)
        quantize_learned(model, targets, text, learning, _progress("learned linear", len(targets)))
        if "lm_head" in plans:  # its error is the logits', not a layer's: GPTQ's codes (exporters.quant.signround)
            plans["lm_head"].record.algorithm = str(Algorithm.gptq)
    elif cfg.algorithm == Algorithm.distill:
        teacher = distill.unquantized_predictions(model, text)  # before any weight is quantized
        quantize_calibrated(model, targets, text, _progress("calibrated linear", len(targets)))
        steps = learning_steps(cfg)
        assert steps is not None
        return distill.distill_scales(model, targets, text, teacher,
                                      distill.Distillation(steps, cfg.learning.lr or distill.DEFAULT_LR),
                                      distill.timed_progress(steps, PROGRESS_LABEL.get()))
    else:
        quantize_calibrated(model, targets, text, _progress("calibrated linear", len(targets)))
    return []


def _mix(model: CausalLM, cfg: QuantConfig, computing: dict[str, RolePlan], text: CalibrationText,
         dtype_bytes: int) -> MixedPrecisionRecord:
    """``quant.size_budget``: measure each 4-bit layer's KL at 4 and 8 bits, upgrade the best per byte within the
    budget, and change the plans (and their records) to say so."""
    assert cfg.size_budget is not None
    plan_of = {name: plan for plan in computing.values() for name in plan.chosen}
    low = {name: plan.precision(name) for name, plan in plan_of.items()}
    modules: dict[str, nn.Linear] = {name: plan_of[name].modules[name] for name in low}  # type: ignore[misc]
    candidates = {name: Candidate(modules[name], p, Precision(EIGHT_BIT_FORM[p.scheme],
                                                              LINEAR_SCHEMES[EIGHT_BIT_FORM[p.scheme]], 0))
                  for name, p in low.items() if p.scheme in EIGHT_BIT_FORM}
    stored: dict[nn.Module, int] = {modules[n]: p.bytes(*modules[n].weight.shape) for n, p in low.items()}
    if cfg.embedding:
        embed = model.model.embed_tokens
        scheme, group = layer_scheme(cfg.embedding, embed.embedding_dim, cfg.embedding_group_size)
        stored[embed] = Precision(scheme, EMBEDDING_SCHEMES[scheme], group).bytes(*embed.weight.shape)
    uniform = weight_bytes(model, stored, dtype_bytes)
    started = time.perf_counter()
    log.info("  %s: measuring %d layers' KL at 4 and 8 bits for quant.size_budget=%s", PROGRESS_LABEL.get(),
             len(candidates), cfg.size_budget)
    sensitivity = measure_sensitivity(model, candidates, text, _progress("sensitivity", len(candidates)))
    upgraded = choose_upgrades(candidates, sensitivity, int((cfg.size_budget - 1.0) * uniform))
    for name in upgraded:
        high, plan = candidates[name].high, plan_of[name]
        plan.chosen[name] = (high.scheme, high.group_size)
        plan.record.layers[name] = high.group_size
        plan.record.upgraded[name] = high.scheme
    return MixedPrecisionRecord(
        budget=cfg.size_budget, uniform_bytes=uniform,
        chosen_bytes=uniform + sum(candidates[n].extra_bytes for n in upgraded),
        all_high_bytes=uniform + sum(c.extra_bytes for c in candidates.values()),
        tokens=min(text.tokens, SENSITIVITY_TOKENS), seconds=round(time.perf_counter() - started, 1),
        sensitivity={n: [round(s.kl_low, 6), round(s.kl_high, 6)] for n, s in sensitivity.items()}, upgraded=upgraded)


def _cast_all_but(model: CausalLM, dtype: torch.dtype, later: set[nn.Module]) -> bool:
    """Cast every floating-point parameter to ``dtype`` but those of ``later`` (cast as they are quantized), in place
    (``.data``, as ``Module.to`` does: tied parameters stay one). Whether any was cast."""
    owned_later = {id(p) for m in later for p in m.parameters(recurse=False)}
    cast = [p for p in model.parameters() if id(p) not in owned_later and p.is_floating_point() and p.dtype != dtype]
    for param in cast:  # one at a time: each stored tensor is freed (or its file pages given back) as it is replaced
        stored = param.data
        param.data = stored.to(dtype)
        release_file_pages([stored])
    return bool(cast) or any(p.is_floating_point() and p.dtype != dtype for m in later for p in m.parameters())


def quantize_model(model: CausalLM, cfg: QuantConfig,
                   tied_storage: TiedEmbeddingStorage = TiedEmbeddingStorage.shared,
                   calibration: Callable[[], CalibrationText] | None = None,
                   shortcuts: bool = True) -> AppliedQuantization:
    """Cast to ``cfg.dtype`` and quantize linears, the embedding and ``lm_head`` in place.

    The checkpoint's own dtype (often bf16) is kept through loading; with a data-free algorithm each layer is cast
    just before it is quantized, so at most one layer exists in both dtypes. A calibrated ``cfg.algorithm`` reads
    its text from ``calibration`` (and casts the whole model first: calibration runs it).

    Linears first: each one's fp32 weight is freed as it is quantized, so the embedding (the largest single matrix,
    whose HQQ pass holds about four fp32 copies of it at once) is quantized beside int8 linears rather than the
    whole fp32 model (the stage's peak on a 1B model, docs/DESIGN.md 2c). lm_head goes last with a data-free
    algorithm, beside the int8 embedding; a calibrated one takes it in the same pass as the linears, since it reads
    their output.
    """
    tying = tied.plan_tied_embedding(model, cfg, tied_storage)
    applied = AppliedQuantization(dtype=str(cfg.dtype), untied_embeddings=tying is tied.TiedEmbedding.UNTIED,
                                  tied_embedding=tying.value)
    head, embed = model.lm_head, model.model.embed_tokens
    if tying is tied.TiedEmbedding.UNTIED:  # one matrix cannot be stored two ways at once
        head.weight = nn.Parameter(embed.weight.detach().clone())
        applied.notes.append(tied.note(tying, cfg))  # type: ignore[arg-type]
    every_linear = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    # LoRA adapters' A and B (models.lora) stay in the model's dtype unless quant.adapters names a scheme.
    adapters = {n: m for n, m in every_linear.items() if is_adapter_module(n)}
    computing = _computing(cfg, tying, {n: m for n, m in every_linear.items() if n not in adapters}, head,
                           applied.notes)
    recast = _prepare(model, cfg, computing, adapters, applied, calibration, shortcuts)
    if "linear" in computing:
        applied.linear = computing["linear"].record
    if cfg.adapters and adapters:
        applied.adapters = _quantize_adapters(cfg, adapters, applied.notes, shortcuts)
    if cfg.embedding:
        embedding = _plan(EMBEDDING_SCHEMES, cfg.embedding, cfg.embedding_group_size, cfg.embedding_algorithm,
                          {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding)},
                          lambda m: m.embedding_dim, applied.notes)
        _apply_data_free("embedding", embedding, cfg.embedding_algorithm, DTYPES[cfg.dtype], shortcuts)
        applied.embedding = embedding.record
    if tying is tied.TiedEmbedding.QUANTIZED_ONCE:
        head.weight = embed.weight  # one quantized tensor serves both
    elif "lm_head" in computing:
        if cfg.algorithm in DATA_FREE:
            _apply_data_free("lm_head", computing["lm_head"], cfg.algorithm, DTYPES[cfg.dtype], shortcuts)
        applied.lm_head = computing["lm_head"].record
    model.tied_head = tying is tied.TiedEmbedding.SHARED
    if recast:
        model.init_buffers()  # KV caches in the model's dtype (fp32 where the attention kernels need it)
    if tying is not tied.TiedEmbedding.UNTIED and (n := tied.note(tying, cfg)):
        applied.notes.append(n)
    return applied


def _quantize_adapters(cfg: QuantConfig, adapters: dict[str, nn.Module], notes: list[str],
                       shortcuts: bool) -> AppliedScheme:
    """LoRA adapters' A and B by ``quant.adapters``, one scale per row: an adapter's rank (lora_B's width) is too
    small for groups. Data-free always: calibration runs the base model."""
    algorithm = cfg.algorithm if cfg.algorithm in DATA_FREE else "hqq"
    plan = _plan(LINEAR_SCHEMES, cfg.adapters, 0, algorithm, adapters, _in_features, notes)  # type: ignore[arg-type]
    _apply_data_free("adapters", plan, algorithm, DTYPES[cfg.dtype], shortcuts)
    return plan.record


def _in_features(module: nn.Module) -> int:
    return module.in_features  # type: ignore[return-value]


def _computing(cfg: QuantConfig, tying: tied.TiedEmbedding, linears: dict[str, nn.Module], head: nn.Module,
               notes: list[str]) -> dict[str, RolePlan]:
    """The plans of the layers that read activations (the linears and an lm_head of its own): their algorithm is
    quant.algorithm, calibrated or not."""
    computing: dict[str, RolePlan] = {}
    if cfg.linear and linears:
        computing["linear"] = _plan(LINEAR_SCHEMES, cfg.linear, cfg.group_size, cfg.algorithm, linears, _in_features,
                                    notes)
    if tying is not tied.TiedEmbedding.QUANTIZED_ONCE and cfg.lm_head:
        computing["lm_head"] = _plan(LINEAR_SCHEMES, cfg.lm_head, cfg.lm_head_group_size, cfg.algorithm,
                                     {"lm_head": head}, _in_features, notes)
    return computing


def _prepare(model: CausalLM, cfg: QuantConfig, computing: dict[str, RolePlan], adapters: dict[str, nn.Module],
             applied: AppliedQuantization, calibration: Callable[[], CalibrationText] | None, shortcuts: bool) -> bool:
    """Cast, rotate, choose the mixed precisions and quantize the linears (calibrated, or data-free): everything
    before the adapters, the embedding and lm_head. Whether any parameter was cast."""
    calibrated = cfg.algorithm not in DATA_FREE and bool(computing)
    # What no data-free pass quantizes (norms, unquantized layers) is cast now; a data-free pass casts each layer it
    # quantizes as it reaches it, so the model is never whole in fp32 (an 8B model's fp32 weights are 32 GB).
    # Calibration and the size budget run the model, so they need all of it in dtype first.
    measured = calibrated or (cfg.size_budget is not None and bool(computing))
    # A rotation turns every matrix in float64 and stores it in dtype: cast first, so it is never stored coarser.
    rotating = rotates(cfg)
    later: set[nn.Module] = set()
    if not (measured or rotating):
        later = {m for p in computing.values() for m in p.modules.values()}
        later |= {m for m in model.modules() if isinstance(m, nn.Embedding)} if cfg.embedding else set()
        later |= set(adapters.values()) if cfg.adapters else set()
    recast = _cast_all_but(model, DTYPES[cfg.dtype], later)
    if recast and (measured or rotating):
        model.init_buffers()  # calibration runs the model (as finding massive activations does): caches in its dtype
    text = None
    if calibrated or (cfg.size_budget is not None and computing) or cfg.rotation != RotationKind.none:
        assert calibration is not None, f"quant={cfg.name} needs a calibration text"
        text = calibration()
    if rotating:  # before any scale is chosen: the rotated weights are what gets quantized (and calibrated)
        learned = cfg.rotation == RotationKind.learned
        learn = None
        if learned:
            assert text is not None and cfg.linear in LINEAR_SCHEMES
            scheme = LINEAR_SCHEMES[cfg.linear]
            learn = learned_rotation.learner(model, text, scheme.grid(cfg.group_size), scheme.dynamic_activations,
                                             cfg.rotation_steps)
        applied.rotation = rotate(model, cfg.rotation != RotationKind.none, cfg.online_hadamard,
                                  keep_tied=tied.is_tied(model),
                                  massive_in=None if calibrated or learned else text, seed=cfg.rotation_seed,
                                  learn=learn)
    if cfg.size_budget is not None and text is not None:
        applied.mixed = _mix(model, cfg, computing, text, DTYPES[cfg.dtype].itemsize)
    if calibrated:
        assert text is not None
        started = time.perf_counter()
        passes = distill.first_and_last_pass(_apply_calibrated(model, cfg, computing, text), len(text.windows))
        applied.calibration = CalibrationRecord(algorithm=str(cfg.algorithm), source=text.source, sha256=text.sha256,
                                                tokens=text.tokens, windows=len(text.windows),
                                                seconds=round(time.perf_counter() - started, 1),
                                                steps=learning_steps(cfg),
                                                kl_first_pass=passes[0] if passes else None,
                                                kl_last_pass=passes[1] if passes else None)
    elif "linear" in computing:
        _apply_data_free("linear", computing["linear"], cfg.algorithm, DTYPES[cfg.dtype], shortcuts)
    return recast
