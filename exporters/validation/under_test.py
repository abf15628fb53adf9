"""The program as validation runs it, and what every check of it shares: made once by the validate stage, handed to
each part's ``validate`` (``exporters.components``)."""

from __future__ import annotations

from dataclasses import dataclass

from exporters.config import DType
from exporters.context.artifacts import BaselineQuality
from exporters.manifest import Checked
from exporters.plan.validation import Tolerance
from exporters.runtime.programs import CapturedPrograms, LoadedProgram
from exporters.runtime.quality import TextWindows


@dataclass(frozen=True)
class ProgramUnderTest:
    """The program as validation runs it, and what every check of it shares (the validate stage makes it once)."""

    program: LoadedProgram | CapturedPrograms  # the .pte in the runtime, or the undelegated programs
    checked: Checked
    baseline: BaselineQuality | None  # the validation text in windows (None: a speech program's own recording)
    tolerance: Tolerance  # the decoder's (a draft's is the plan's component_tolerance)
    context: int  # the cache's positions: speculation stops before them
    eager_graphs: CapturedPrograms | None = None  # PT2E: the quantized model exists only as these graphs
    runs_in: DType | None = None  # the precision the device computes in, when coarser than quant.dtype
    eager_kv_dtype: str | None = None  # the eager side's cache dtype, when it is not the program's

    @property
    def text(self) -> TextWindows:
        assert self.baseline is not None, "a language model's check: the baseline stage made the windows"
        return self.baseline.text
