"""What one export knows besides the artifact in hand: the plan, the output folder, the timings, and the facts each
stage learns, one record per part of the program (``exporters.components``), keyed by the part's name.

The artifacts the stages hand each other are in :mod:`exporters.context.artifacts`. A part's record is its kind's
own dataclass (``exporters.components.*``); the context knows none of them. The decoder is the program's main model:
its checkpoint, quantization and validation are the manifest's top-level ones, read here as :attr:`checkpoint`,
:attr:`quantization` and :attr:`validation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exporters.config import ExportConfig
    from exporters.context.artifacts import BaselineQuality
    from exporters.manifest import AppliedQuantization, LoweringTimes, Pt2eRecord, QualityWarning, ValidationReport
    from exporters.plan import ExportPlan
    from exporters.plan.footprint import Footprint
    from models.checkpoint import Checkpoint


@dataclass
class ExportContext:
    """What one export knows besides the artifact in hand. Stages fill in the facts as they learn them."""

    plan: ExportPlan  # every decision of the export, resolved once from the checked config
    output_dir: Path
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds, filled in by the pipeline
    # stage -> the process's peak RSS (MiB) when it ended: the peak so far (VmHWM is monotone unless an observer
    # resets it per stage, as benchmarks.profile_memory does). Filled in by the pipeline.
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    # Each part's facts (its checkpoint, quantization, validation, ...), by part name: exporters.components.
    records: dict[str, Any] = field(default_factory=dict)
    footprint: Footprint | None = None  # load: the export's estimated memory
    baseline: BaselineQuality | None = None  # baseline: the validation text in windows, the decoder's score on it
    pt2e: Pt2eRecord | None = None  # pt2e: what the backend's quantizer did (finalize records it with quantize's)
    quality_warning: QualityWarning | None = None  # advise: the perplexity increase passed its threshold
    lowering: LoweringTimes | None = None  # lower: its seconds per method and per pass

    @property
    def config(self) -> ExportConfig:
        return self.plan.config

    def record(self, name: str) -> Any:
        """The record of part ``name`` (made by its kind when the part is opened at load)."""
        return self.records[name]

    @property
    def main(self) -> Any:
        """The record of the program's main model (the decoder, or a speech model)."""
        return self.records.get(self.plan.main.name)

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The decoder's checkpoint (load)."""
        return None if self.main is None else self.main.checkpoint

    @property
    def quantization(self) -> AppliedQuantization | None:
        """What quantize did to the decoder."""
        return None if self.main is None else self.main.quantization

    @property
    def validation(self) -> ValidationReport | None:
        """The decoder's methods against its eager model (validate)."""
        return None if self.main is None else self.main.validation
