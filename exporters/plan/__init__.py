"""The export plan: every decision and derived value of one export, resolved once from the checked config.

``exporters.components.resolve.plan_export(cfg)`` checks the composed config (every rule, before any work) and
resolves it into a frozen :class:`ExportPlan`, defined here with the types it is made of: the lengths every method
and cache is built for, the backend's capabilities, the components the program holds (each with its model build,
quantization and methods), the validation plan, the stages that will run. The plan's types hold program's and quant's
(a method table, a quant plan) and import nothing above them; the kinds that resolve a plan sit above it. Stages, the memory estimate, advise, finalize and the manifest read the plan; none re-derives a value from the
config. Fields and their readers: docs/ARCHITECTURE.md, "The export plan".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from exporters.config import BenchmarkConfig, ExportConfig, WeightsPlacement
from exporters.plan.backend import BackendCapabilities
from exporters.plan.component import Component, ComponentKind, ModelBuild, QuantPlan, StatePlan
from exporters.plan.validation import Tolerance, ValidationPlan
from exporters.program.layouts import Layout
from exporters.program.lengths import Lengths
from exporters.program.methods import MethodTable

__all__ = ["BackendCapabilities", "Component", "ComponentKind", "ExportPlan", "Lengths", "ModelBuild", "QuantPlan",
           "StatePlan", "Tolerance", "ValidationPlan"]


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
    shortcuts: bool  # asked for, and the checked versions installed (exporters.program.versions)
    memory_limit_gb: float | None
    output_name: str

    @property
    def main(self) -> Component:
        """The program's main model, always its first component: the decoder (an LLM), or a speech model."""
        return self.components[0]

    def component(self, name: str) -> Component:
        """The component named ``name`` (``decoder``, ``draft``, ``vision``)."""
        return next(c for c in self.components if c.name == name)

    @property
    def methods(self) -> "MethodTable":
        """Every method of the program: the main model's (its adapters' included), then each other component's."""
        table = self.main.methods
        for component in self.components[1:]:
            table = table.with_component(component.methods)
        return table

    @property
    def stage_names(self) -> list[str]:
        """The stages this export runs, in order; stages that would do nothing are left out."""
        v, q, llm = self.validation, self.main.quant.config, self.main.is_language_model
        return ["load", *(["baseline"] if v else []), "quantize", *(["pt2e"] if q.pt2e is not None else []),
                "capture", "lower", "emit", *(["validate"] if v else []),
                *(["advise"] if v and llm and v.advise_threshold is not None else []), "finalize",
                *(["bench"] if self.bench else [])]

    def digest(self) -> str:
        """sha256 of everything that decides the program and its manifest (not where it is written): two exports
        with the same digest write the same program."""
        data = dataclasses.asdict(self)
        data.pop("resolved_config")
        data["config"]["export"].pop("output_dir", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
