"""A list of stages run in order, each turning one typed artifact into the next.

The session knows nothing about particular stages: it times them, logs progress, and hands each
stage's output to the next (the shape argued for in ExecuTorch's export-recipe review).
"""

from __future__ import annotations

import ctypes
import gc
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


def return_freed_memory() -> None:
    """Hand memory the last stage freed back to the operating system.

    Each stage drops what the next one does not need (fp32 weights after quantize, graphs after lower), but
    glibc keeps freed heap pages mapped, so they still count in the process's RSS and stack up under the
    next stage's peak. ``malloc_trim`` releases them: on the 134M preset the export's peak RSS went from
    1767 to 1574 MB. A no-op where the C library is not glibc.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def run_pipeline(stages: Sequence[Stage], artifact: Any = None, first: int = 1,
                 total: int | None = None) -> tuple[Any, dict[str, float]]:
    """Run ``stages`` in order; the last artifact and each stage's wall time in seconds.

    ``first`` and ``total`` number the progress lines when one export runs its stages in more than one call.
    """
    total = total or first + len(stages) - 1
    timings: dict[str, float] = {}
    for index, stage in enumerate(stages, start=first):
        log.info("[%d/%d] %s ...", index, total, stage.name)
        start = time.perf_counter()
        artifact = stage.run(artifact)
        return_freed_memory()
        timings[stage.name] = round(time.perf_counter() - start, 3)
        summary = getattr(artifact, "summary", lambda: "")()
        log.info("[%d/%d] %s done in %.1f s%s", index, total, stage.name, timings[stage.name],
                 f": {summary}" if summary else "")
    return artifact, timings
