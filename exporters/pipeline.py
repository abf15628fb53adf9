"""A list of stages run in order, each turning one typed artifact into the next.

The session knows nothing about particular stages: it times them, logs progress, and hands each
stage's output to the next (the shape argued for in ExecuTorch's export-recipe review).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any, Sequence

log = logging.getLogger("exporters")


class Stage(ABC):
    """One step of an export. Built with only its own sub-config; ``run`` gets the previous artifact."""

    name: str

    @abstractmethod
    def run(self, artifact: Any) -> Any: ...


def run_pipeline(stages: Sequence[Stage], timings: dict[str, float], artifact: Any = None) -> Any:
    """Run ``stages`` in order, recording each one's wall time (seconds) in ``timings``."""
    for index, stage in enumerate(stages, start=1):
        log.info("[%d/%d] %s ...", index, len(stages), stage.name)
        start = time.perf_counter()
        artifact = stage.run(artifact)
        timings[stage.name] = round(time.perf_counter() - start, 3)
        summary = getattr(artifact, "summary", lambda: "")()
        log.info("[%d/%d] %s done in %.1f s%s", index, len(stages), stage.name, timings[stage.name],
                 f": {summary}" if summary else "")
    return artifact
