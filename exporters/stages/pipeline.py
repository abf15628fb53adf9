"""One export is one run of a list of stages; each turns the artifact it is handed into a new one.

The pipeline knows nothing about particular stages (the shape of ExecuTorch's ``export/stages.py``): it checks
that every stage's declared predecessors run before it, times each stage into the :class:`ExportContext`, logs
progress, and hands each stage's artifact to the next. The context carries what is not an artifact: the
config, the output folder, the timings, and the facts a stage leaves for later ones (the checkpoint, the
baseline's quality, the applied quantization, the validation report).

Ownership: a stage receives the only reference to its input, so a stage that consumes it (lower rewrites the
captured programs, emit consumes the edge programs) frees it by dropping its own name for it, without editing
the artifact. Artifacts are frozen; a stage returns a new one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Literal, Protocol, Sequence

from exporters.context import ExportContext
from exporters.errors import Interrupted
from exporters.output.interrupts import signal_of
from exporters.runtime.memory import collecting_new_objects_only, peak_rss_mb, return_freed_memory

if TYPE_CHECKING:
    from exporters.plan import ExportPlan

log = logging.getLogger("exporters")

# A stage still running after this many seconds says so, and again at every multiple: lowering a real model
# spends minutes inside one ExecuTorch call that reports nothing.
HEARTBEAT_S = 60.0

StageName = Literal["load", "baseline", "quantize", "pt2e", "capture", "lower", "emit", "validate", "advise",
                    "finalize", "bench"]


class Stage(ABC):
    """One step of an export. Built from the export plan (it reads its own part); ``run`` gets the previous
    artifact."""

    name: ClassVar[StageName]
    # Stages that must have run earlier in the same pipeline (whichever others run between them).
    after: ClassVar[tuple[StageName, ...]] = ()

    def __init__(self, plan: ExportPlan) -> None:
        self.plan = plan

    @abstractmethod
    def run(self, artifact: Any, ctx: ExportContext) -> Any: ...

    def models_of(self, artifact: Any) -> dict[str, Any]:
        """An artifact's models by component name, as the parts' hooks take them: the decoder's, then the others'."""
        return {self.plan.main.name: artifact.model, **artifact.components}

    def describe(self, artifact: Any, ctx: ExportContext) -> str:
        """What the stage's ``done`` line says: by default, the new artifact's own summary."""
        return getattr(artifact, "summary", lambda: "")()


class StageObserver(Protocol):
    """Told when each stage starts and ends (``benchmarks.profile_memory`` measures peak RSS per stage)."""

    def stage_started(self, name: str) -> None: ...

    def stage_finished(self, name: str, seconds: float) -> None: ...


@contextlib.contextmanager
def heartbeat(stage: str, every: float = HEARTBEAT_S) -> Iterator[None]:
    """Log ``<stage>: still running (N s)`` every ``every`` seconds until the block ends."""
    done = threading.Event()
    start = time.perf_counter()

    def beat() -> None:
        while not done.wait(every):
            log.info("  %s: still running (%.0f s)", stage, time.perf_counter() - start)

    thread = threading.Thread(target=beat, name=f"heartbeat-{stage}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def check_order(stages: Sequence[Stage]) -> None:
    """Every stage's declared predecessors come before it (a programming error otherwise, not a user's)."""
    seen: set[str] = set()
    for stage in stages:
        missing = [name for name in stage.after if name not in seen]
        if missing:
            raise ValueError(f"stage {stage.name} must run after {', '.join(missing)}; "
                             f"the pipeline is {', '.join(s.name for s in stages)}")
        seen.add(stage.name)


def _run_stage(stage: Stage, handed: list[Any], ctx: ExportContext, step: str, observer: StageObserver | None) -> Any:
    """One stage, timed and logged. ``handed`` holds the only reference to its input, which the stage is given
    (popped from the list): what the stage drops is freed."""
    log.info("%s %s ...", step, stage.name)
    if observer:
        observer.stage_started(stage.name)
    start = time.perf_counter()
    with heartbeat(stage.name):
        artifact = stage.run(handed.pop(), ctx)
    return_freed_memory()
    seconds = time.perf_counter() - start
    ctx.timings[stage.name] = round(seconds, 3)
    ctx.peak_rss_mb[stage.name] = round(peak_rss_mb())
    if observer:
        observer.stage_finished(stage.name, seconds)
    summary = stage.describe(artifact, ctx)
    log.info("%s %s done in %.1f s%s", step, stage.name, seconds, f": {summary}" if summary else "")
    return artifact


def run_pipeline(stages: Sequence[Stage], ctx: ExportContext, artifact: Any = None,
                 stop_after: str | None = None, observer: StageObserver | None = None) -> Any:
    """Run ``stages`` in order (up to and including ``stop_after``, if given); the last artifact."""
    check_order(stages)
    names = [s.name for s in stages]
    if stop_after is not None and stop_after not in names:
        raise ValueError(f"stop_after={stop_after!r} is not a stage of this export: {', '.join(names)}")
    todo = list(stages[:names.index(stop_after) + 1] if stop_after else stages)
    with collecting_new_objects_only():
        for index, stage in enumerate(todo, start=1):
            handed, artifact = [artifact], None
            try:
                artifact = _run_stage(stage, handed, ctx, f"[{index}/{len(todo)}]", observer)
            except Interrupted:
                raise
            except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: which stage it stopped, not a page of traceback
                raise Interrupted(stage.name, signal_of(stop)) from None
    return artifact
