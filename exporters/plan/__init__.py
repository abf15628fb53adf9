"""The export plan: every decision and derived value of one export, resolved once from the checked config.

``plan_export(cfg)`` checks the composed config (every rule, before any work) and resolves it into a frozen
:class:`ExportPlan`: the lengths every method and cache is built for, the backend's capabilities, the components
the program holds (each with its model build, quantization and methods), the validation plan, the stages that will
run. Stages, the memory estimate, advise, finalize and the manifest read the plan; none re-derives a value from the
config. Fields and their readers: docs/ARCHITECTURE.md, "The export plan".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from omegaconf import DictConfig, OmegaConf

from exporters.config import (AdapterMode, Attention, BenchmarkConfig, ExportConfig, KvDType, WeightsPlacement,
                              exhaustive, to_typed)
from exporters.errors import UserError
from exporters.plan.backend import BackendCapabilities
from exporters.plan.component import Component, ComponentKind, ModelBuild, QuantPlan, StatePlan
from exporters.plan.lengths import Lengths
from exporters.plan.validation import Tolerance, ValidationPlan, coarser, prompt_length
from exporters.program.layouts import LAYOUTS, Layout
from exporters.versions import shortcuts_allowed

if TYPE_CHECKING:
    from exporters.program.methods import MethodTable

__all__ = ["BackendCapabilities", "Component", "ComponentKind", "ExportPlan", "Lengths", "ModelBuild", "QuantPlan",
           "StatePlan", "Tolerance", "ValidationPlan", "check_config", "plan_export"]


@dataclass(frozen=True)
class ExportPlan:
    config: ExportConfig  # the checked config the plan was resolved from
    resolved_config: dict[str, Any]  # the config as composed, for the manifest
    lengths: Lengths
    backend: BackendCapabilities
    layout: Layout
    weights: WeightsPlacement
    components: tuple[Component, ...]
    validation: ValidationPlan | None  # None: validate=false
    bench: BenchmarkConfig | None  # None: no bench stage
    # Validation runs the undelegated programs where the delegate cannot run here; with PT2E they are also the
    # eager side (the quantized model exists only as the converted graph).
    keep_undelegated: bool
    shortcuts: bool  # asked for, and the checked versions installed (exporters.versions)
    memory_limit_gb: float | None
    output_name: str

    @property
    def decoder(self) -> Component:
        return next(c for c in self.components if c.kind == ComponentKind.decoder)

    @property
    def draft(self) -> Component | None:
        """The draft model proposing tokens for the decoder's verify method (draft.checkpoint), if any."""
        return next((c for c in self.components if c.kind == ComponentKind.draft), None)

    @property
    def vision(self) -> Component | None:
        """A vision-language checkpoint's image encoder (exporters.program.vision), if any."""
        return next((c for c in self.components if c.kind == ComponentKind.vision_encoder), None)

    @property
    def language_models(self) -> list[Component]:
        """The components scored on text (the decoder and a draft; not the vision encoder)."""
        return [c for c in self.components if c.is_language_model]

    @property
    def methods(self) -> "MethodTable":
        """Every method of the program: the decoder's (its adapters' included), then each other component's."""
        table = self.decoder.methods
        for component in self.components:
            if not component.is_decoder:
                table = table.with_component(component.methods)
        return table

    @property
    def stage_names(self) -> list[str]:
        """The stages this export runs, in order; stages that would do nothing are left out."""
        v, q = self.validation, self.decoder.quant.config
        return ["load", *(["baseline"] if v else []), "quantize", *(["pt2e"] if q.pt2e is not None else []),
                "capture", "lower", "emit", *(["validate"] if v else []),
                *(["advise"] if v and v.advise_threshold is not None else []), "finalize",
                *(["bench"] if self.bench else [])]

    def digest(self) -> str:
        """sha256 of everything that decides the program and its manifest (not where it is written): two exports
        with the same digest write the same program."""
        data = dataclasses.asdict(self)
        data.pop("resolved_config")
        data["config"]["export"].pop("output_dir", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def bench_runs(cfg: ExportConfig, sweeping: bool) -> bool:
    """``bench``: as set, else on in sweeps (people sweep to compare: every job measured) and off for one export."""
    return cfg.bench if cfg.bench is not None else sweeping


def check_config(cfg: ExportConfig, overrides: Sequence[str] = (), sweeping: bool = False) -> None:
    """Every rule that spans fields or needs a registry, each checked by the module that owns those keys;
    ``overrides``: the command line's, for what composition hides (an adapter named twice); ``sweeping``: a job of
    a sweep (``-m``)."""
    from exporters.program.backends import check_backend
    from exporters.program.cache import check_kv_cache
    from exporters.program.draft import check_draft
    from exporters.program.methods import check_methods
    from exporters.program.swappable import base_quant, check_swappable, slot_plan
    from exporters.program.vision import check_vision, vision_geometry
    from exporters.program.weights import check_weights
    from exporters.quant.pt2e import check_pt2e
    from exporters.quant.schemes import check_quant
    from exporters.runtime.quality import check_validation
    from exporters.sweeps.summary import check_search
    from models.families import check_family
    from models.lora import check_adapter_folders, check_adapter_overrides

    check_adapter_overrides(list(overrides))
    check_family(cfg.model.family)
    check_adapter_folders(cfg.model.adapters)
    check_backend(cfg.backend, bench_runs(cfg, sweeping))
    check_quant(base_quant(cfg), cfg.backend)  # swappable slots' quant.adapters: check_swappable
    check_pt2e(cfg.quant, cfg.backend, list(cfg.model.adapters))
    check_swappable(cfg)
    slot_plan(cfg)
    lengths = Lengths.of_config(cfg)
    check_methods(cfg.export, cfg.backend, lengths, cfg.draft, cfg.quant)
    check_draft(cfg)
    check_vision(cfg, lengths, vision_geometry(cfg.model), cfg.backend.dynamic_shapes)
    check_kv_cache(cfg.export, cfg.backend, cfg.quant, lengths)
    with_methods = list(cfg.model.adapters) if cfg.export.adapters == AdapterMode.methods else []
    check_weights(cfg.export, cfg.backend, with_methods)
    check_validation(cfg.validation, enabled=cfg.validate)
    for name in ("prompt_tokens", "steps", "repeats"):
        if getattr(cfg.benchmark, name) < 1:
            raise UserError(f"benchmark.{name}={getattr(cfg.benchmark, name)}: use 1 or more.")
    check_search(cfg.search)


def _closed_sets() -> None:
    """Each registry keyed by a closed set of the schema covers exactly that set."""
    from exporters.quant.pt2e import PT2E_QUANTIZERS
    from exporters.config import Pt2eQuantizer
    from models.decoder import ATTENTION
    from models.kv_cache import KV_CACHES

    exhaustive(Pt2eQuantizer, PT2E_QUANTIZERS, "exporters.quant.pt2e.PT2E_QUANTIZERS")
    exhaustive(Attention, ATTENTION, "models.decoder.ATTENTION")
    exhaustive(KvDType, KV_CACHES, "models.kv_cache.KV_CACHES")


def resolve(cfg: ExportConfig, resolved_config: dict[str, Any], sweeping: bool = False) -> ExportPlan:
    """The plan of a config that passed :func:`check_config`."""
    from exporters.program.draft import draft_component
    from exporters.program.methods import MethodTable, with_verify
    from exporters.program.swappable import base_quant, slot_plan
    from exporters.program.vision import vision_component, vision_geometry, with_multimodal

    _closed_sets()
    ex, backend = cfg.export, BackendCapabilities.of(cfg.backend)
    lengths = Lengths.of_config(cfg)
    shortcuts = shortcuts_allowed(ex.shortcuts)
    layout = LAYOUTS[ex.layout]
    state = StatePlan(lengths.context, lengths.call_tokens, ex.kv_dtype, ex.attention_sink)
    geometry = vision_geometry(cfg.model)
    decoder = Component(
        name="decoder", kind=ComponentKind.decoder,
        build=ModelBuild(cfg.model, state, backend.attention),
        quant=QuantPlan(base_quant(cfg), ex.tied_embedding, shortcuts),
        # Aliases (forward = prefill) are emitted as renamed plans, a shortcut through the emitter's internals.
        methods=MethodTable.of(with_multimodal(with_verify(ex.methods, cfg.draft), geometry), layout, lengths,
                               list(cfg.model.adapters), share_graphs=shortcuts, slots=slot_plan(cfg)))
    draft = draft_component(cfg.draft, cfg.quant, state, backend.attention, lengths, ex.tied_embedding, shortcuts)
    vision = vision_component(cfg, geometry, shortcuts)
    pt2e = cfg.quant.pt2e is not None
    validation = None
    if cfg.validate:
        runs_in = backend.runs_in if coarser(backend.runs_in, cfg.quant.dtype) else None
        quantized_kv = ex.kv_dtype != KvDType.fp32
        validation = ValidationPlan(
            config=cfg.validation,
            prompt_tokens=prompt_length(cfg.validation.prompt_tokens, lengths.context, lengths.prefill_chunk),
            tolerance=Tolerance.of(cfg.quant, runs_in, cfg.validation.int8_kv if quantized_kv else None),
            runs_in=runs_in, in_runtime=backend.runs_here, eager_from_graphs=pt2e,
            eager_kv_dtype=KvDType.fp32 if quantized_kv else None,
            component_tolerance={} if draft is None else {draft.name: Tolerance.of(
                draft.quant.config, backend.runs_in if coarser(backend.runs_in, draft.quant.config.dtype) else None,
                cfg.validation.int8_kv if quantized_kv else None)})
    return ExportPlan(
        config=cfg, resolved_config=resolved_config, lengths=lengths, backend=backend, layout=layout,
        weights=ex.weights, components=tuple(c for c in (decoder, draft, vision) if c is not None),
        validation=validation,
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
