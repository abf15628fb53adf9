"""Where lowering's time goes: seconds per method and per pass, read while ExecuTorch lowers (the manifest's
``lowering``), so that the next regression shows in a manifest rather than in a profiler.

Timing wrappers on public APIs only, entered around ``to_edge_transform_and_lower``: torch's
``ExportedProgram.run_decompositions`` (counted per method), torch.fx's ``PassBase.__call__`` (the outermost pass of
each call timed under its class name: the edge dialect's passes and the backend's), ExecuTorch's
``EdgeProgramManager`` (built once every method is in the edge dialect) and ``BackendDetails.preprocess_multimethod``
(each method's partitions timed apart where a backend keeps that default, which preprocesses one method after
another). Which method is converted is told by the partitioner that ExecuTorch asks about each method in turn
(``exporters.stages.lower.with_progress``). Nothing here changes what is lowered.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, defaultdict
from typing import Any, Iterator

from exporters.manifest import LoweringTimes, MethodLowering


class LoweringClock:
    """Filled while lowering runs (:meth:`running`); :meth:`times` is what the manifest records."""

    def __init__(self) -> None:
        self.method: str | None = None  # the method being converted to the edge dialect
        self.since = 0.0
        self.to_edge: dict[str, float] = defaultdict(float)
        self.decompositions: Counter[str] = Counter()
        self.partition: dict[str, float] = {}
        self.partitions: dict[str, int] = {}
        self.preprocess: dict[str, float] = defaultdict(float)
        self.passes: dict[str, float] = defaultdict(float)
        self.pass_runs: Counter[str] = Counter()
        self._in_pass = False

    def converting(self, method: str) -> None:
        """ExecuTorch starts converting ``method`` to the edge dialect (the one before it is done)."""
        self._converted()
        self.method, self.since = method, time.perf_counter()

    def _converted(self) -> None:
        if self.method is not None:
            self.to_edge[self.method] += time.perf_counter() - self.since
            self.method = None

    def partitioned(self, method: str, seconds: float, partitions: int) -> None:
        self.partition[method] = self.partition.get(method, 0.0) + seconds
        self.partitions[method] = self.partitions.get(method, 0) + partitions

    def times(self, total_s: float) -> LoweringTimes:
        methods = {name: MethodLowering(to_edge_s=round(self.to_edge.get(name, 0.0), 2),
                                        decompositions=self.decompositions[name],
                                        partition_s=round(self.partition.get(name, 0.0), 2),
                                        preprocess_s=round(self.preprocess.get(name, 0.0), 2),
                                        partitions=self.partitions.get(name, 0))
                   for name in dict.fromkeys([*self.to_edge, *self.partition])}
        accounted = sum(m.to_edge_s + m.partition_s + m.preprocess_s for m in methods.values())
        return LoweringTimes(methods=methods,
                             passes_s={k: round(v, 2) for k, v in sorted(self.passes.items(), key=lambda kv: -kv[1])},
                             pass_runs=dict(self.pass_runs), other_s=round(max(0.0, total_s - accounted), 2),
                             total_s=round(total_s, 2))

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Within this block, lowering's decompositions, passes and preprocessing are timed into this clock."""
        from executorch.exir import EdgeProgramManager
        from executorch.exir.backend.backend_details import BackendDetails
        from torch.export import ExportedProgram
        from torch.fx.passes.infra.pass_base import PassBase

        clock = self
        decompose, call, manager_init = ExportedProgram.run_decompositions, PassBase.__call__, EdgeProgramManager.__init__
        preprocess_all = BackendDetails.__dict__["preprocess_multimethod"]  # the classmethod object

        def counted_decompositions(program: Any, *args: Any, **kwargs: Any) -> Any:
            if clock.method is not None:
                clock.decompositions[clock.method] += 1
            return decompose(program, *args, **kwargs)

        def timed_pass(pass_: Any, *args: Any, **kwargs: Any) -> Any:
            if clock._in_pass:  # a pass run by another: the outer one's time
                return call(pass_, *args, **kwargs)
            clock._in_pass, started = True, time.perf_counter()
            try:
                return call(pass_, *args, **kwargs)
            finally:
                clock._in_pass = False
                name = type(pass_).__name__
                clock.passes[name] += time.perf_counter() - started
                clock.pass_runs[name] += 1

        def edge_programs_made(manager: Any, *args: Any, **kwargs: Any) -> None:
            clock._converted()  # every method is in the edge dialect
            manager_init(manager, *args, **kwargs)

        def method_by_method(cls: Any, edge_programs: dict[str, list[Any]], compile_specs: dict[str, Any]) -> Any:
            results = {}
            for method, programs in edge_programs.items():
                started = time.perf_counter()
                results.update(preprocess_all.__func__(cls, {method: programs}, {method: compile_specs[method]}))
                clock.preprocess[method] += time.perf_counter() - started
            return results

        ExportedProgram.run_decompositions = counted_decompositions  # type: ignore[method-assign]
        PassBase.__call__ = timed_pass  # type: ignore[method-assign]
        EdgeProgramManager.__init__ = edge_programs_made  # type: ignore[method-assign]
        BackendDetails.preprocess_multimethod = classmethod(method_by_method)  # type: ignore[assignment]
        try:
            yield
        finally:
            ExportedProgram.run_decompositions = decompose  # type: ignore[method-assign]
            PassBase.__call__ = call  # type: ignore[method-assign]
            EdgeProgramManager.__init__ = manager_init  # type: ignore[method-assign]
            BackendDetails.preprocess_multimethod = preprocess_all  # type: ignore[assignment]
            self._converted()
