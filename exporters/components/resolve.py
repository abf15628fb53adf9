"""Check a config and resolve its plan: every rule and every decision of an export, before any work.

``check_config`` runs the rules that span several groups of keys, each owned by the module of that group, then asks
each kind of component to check its own part (:meth:`Kind.check`). ``resolve`` asks each kind for its component
(:meth:`Kind.plan`), the other components before the decoder (which gets the methods they need of it), and freezes
the :class:`~exporters.plan.ExportPlan`. It sits above the plan's types, the program, quant and the kinds it asks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from exporters.backends import check_backend
from exporters.components import KINDS
from exporters.components.kind import Basis
from exporters.config import AdapterMode, Attention, ExportConfig, KvDType, Pt2eQuantizer, exhaustive, to_typed
from exporters.plan import ExportPlan
from exporters.plan.backend import BackendCapabilities
from exporters.plan.component import ComponentKind, StatePlan
from exporters.plan.validation import Tolerance, ValidationPlan, coarser, prompt_length
from exporters.program.cache import check_kv_cache
from exporters.program.layouts import LAYOUTS
from exporters.program.lengths import Lengths
from exporters.program.methods import check_methods
from exporters.program.swappable import base_quant
from exporters.program.versions import shortcuts_allowed
from exporters.program.weights import check_weights
from exporters.quant.pt2e import PT2E_QUANTIZERS, check_pt2e
from exporters.quant.schemes import check_quant
from exporters.runtime.quality import check_validation
from exporters.sweeps.summary import check_search
from models.decoder import ATTENTION
from models.families import check_family
from models.kv_cache import KV_CACHES
from models.lora import check_adapter_overrides


def bench_runs(cfg: ExportConfig, sweeping: bool) -> bool:
    """``bench``: as set, else on in sweeps (people sweep to compare: every job measured) and off for one export."""
    return cfg.bench if cfg.bench is not None else sweeping


def check_config(cfg: ExportConfig, overrides: Sequence[str] = (), sweeping: bool = False) -> None:
    """Every rule that spans fields or needs a registry, each checked by the module that owns those keys, then each
    kind's own; ``overrides``: the command line's, for what composition hides (an adapter named twice);
    ``sweeping``: a job of a sweep (``-m``)."""
    check_adapter_overrides(list(overrides))
    check_family(cfg.model.family)
    check_backend(cfg.backend, bench_runs(cfg, sweeping))
    check_quant(base_quant(cfg), cfg.backend)  # swappable slots' quant.adapters: exporters.components.slots
    check_pt2e(cfg.quant, cfg.backend, list(cfg.model.adapters))
    lengths = Lengths.of_config(cfg)
    for kind in KINDS.values():
        kind.check(cfg, lengths)
    check_methods(cfg.export, cfg.backend, lengths, cfg.draft, cfg.quant)
    check_kv_cache(cfg.export, cfg.backend, cfg.quant, lengths)
    with_methods = list(cfg.model.adapters) if cfg.export.adapters == AdapterMode.methods else []
    check_weights(cfg.export, cfg.backend, with_methods)
    check_validation(cfg.validation, enabled=cfg.validate)
    check_search(cfg.search)


def _closed_sets() -> None:
    """Each registry keyed by a closed set of the schema covers exactly that set."""
    exhaustive(Pt2eQuantizer, PT2E_QUANTIZERS, "exporters.quant.pt2e.PT2E_QUANTIZERS")
    exhaustive(Attention, ATTENTION, "models.decoder.ATTENTION")
    exhaustive(KvDType, KV_CACHES, "models.kv_cache.KV_CACHES")
    exhaustive(ComponentKind, {k: v for k, v in KINDS.items() if not v.variant}, "exporters.components.KINDS")


def _validation(cfg: ExportConfig, backend: BackendCapabilities, lengths: Lengths,
                others: Sequence[Any]) -> ValidationPlan | None:
    """How the program is validated (None: validate=false): the decoder's tolerance, and each other language
    model's by its own quant config."""
    if not cfg.validate:
        return None
    quantized_kv = cfg.export.kv_dtype != KvDType.fp32
    int8_kv = cfg.validation.int8_kv if quantized_kv else None

    def runs_in(dtype: Any) -> Any:
        return backend.runs_in if coarser(backend.runs_in, dtype) else None

    return ValidationPlan(
        config=cfg.validation,
        prompt_tokens=prompt_length(cfg.validation.prompt_tokens, lengths.context, lengths.prefill_chunk),
        tolerance=Tolerance.of(cfg.quant, runs_in(cfg.quant.dtype), int8_kv),
        runs_in=runs_in(cfg.quant.dtype), in_runtime=backend.runs_here, eager_from_graphs=cfg.quant.pt2e is not None,
        eager_kv_dtype=KvDType.fp32 if quantized_kv else None,
        component_tolerance={c.name: Tolerance.of(c.quant.config, runs_in(c.quant.config.dtype), int8_kv)
                             for c in others if c.is_language_model})


def resolve(cfg: ExportConfig, resolved_config: dict[str, Any], sweeping: bool = False) -> ExportPlan:
    """The plan of a config that passed :func:`check_config`."""
    _closed_sets()
    ex, backend = cfg.export, BackendCapabilities.of(cfg.backend)
    lengths = Lengths.of_config(cfg)
    shortcuts = shortcuts_allowed(ex.shortcuts)
    basis = Basis(lengths, StatePlan(lengths.context, lengths.call_tokens, ex.kv_dtype, ex.attention_sink),
                  backend.attention, shortcuts)
    decoder_kind = KINDS[str(ComponentKind.decoder)]
    # A main model other than the decoder claims its checkpoint first (a speech model); the program is then its own.
    claimed = [c for kind in KINDS.values() if kind.main and kind is not decoder_kind
               for c in [kind.plan(cfg, basis)] if c is not None]
    # The other components first: the decoder gets the methods they need of it.
    others = [] if claimed else [c for kind in KINDS.values() if not kind.variant and not kind.main
                                 for c in [kind.plan(cfg, basis)] if c is not None]
    needed = tuple(dict.fromkeys(k for c in others for k in KINDS[c.kind].decoder_methods(c)))
    state = tuple(dict.fromkeys(s for c in others for s in KINDS[c.kind].decoder_state(c)))
    adapted = tuple((k, a) for c in others for k, a in KINDS[c.kind].decoder_adapters(c).items())
    decoder = claimed[0] if claimed else decoder_kind.plan(cfg, dataclasses.replace(
        basis, decoder_methods=needed, decoder_state=state, decoder_adapters=adapted))
    assert decoder is not None
    pt2e = cfg.quant.pt2e is not None
    return ExportPlan(
        config=cfg, resolved_config=resolved_config, lengths=lengths, backend=backend, layout=LAYOUTS[ex.layout],
        weights=ex.weights, components=(decoder, *others), validation=_validation(cfg, backend, lengths, others),
        bench=cfg.benchmark if bench_runs(cfg, sweeping) else None,
        keep_undelegated=cfg.validate and (pt2e or not backend.runs_here),
        shortcuts=shortcuts, memory_limit_gb=ex.memory_limit_gb, output_name=ex.output_name)


def plan_export(cfg: DictConfig | ExportConfig, overrides: Sequence[str] = (), sweeping: bool = False) -> ExportPlan:
    """Check ``cfg`` (composed by Hydra, or already typed) and resolve its plan, before any work. ``overrides``:
    the command line it was composed from, when there is one; ``sweeping``: the export is a job of a sweep."""
    if isinstance(cfg, DictConfig):
        typed, resolved = to_typed(cfg), OmegaConf.to_container(cfg, resolve=True)
    else:
        typed, resolved = cfg, dataclasses.asdict(cfg)
    assert isinstance(resolved, dict)
    check_config(typed, overrides, sweeping)
    return resolve(typed, resolved, sweeping)
