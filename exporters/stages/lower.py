"""Lower: every method and the constant methods into ONE EdgeProgramManager, in one call.

``to_edge_transform_and_lower`` with a dict of programs runs ExecuTorch's multi-method ``to_backend``:
the backend preprocesses all methods together and stores each weight once (XNNPACK's NamedDataStore
keys constants by the sha256 of their bytes; with export.weights=external, by tensor name: exporters.program.weights).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator

from exporters.components import parts
from exporters.config import WeightsPlacement
from exporters.context import ExportContext
from exporters.context.artifacts import CapturedMethods, LoweredProgram
from exporters.backends import BACKENDS, Backend, partitioners
from exporters.program.clock import LoweringClock
from exporters.program.dynamic import convolutions_unguarded
from exporters.program.internals import (cia_ops_collected_once, edge_passes_only_where_they_apply,
                                         edge_programs_decomposed_once, lowering_forgets_graphs, named_data_stored_once,
                                         torchao_quant_ops_shape_only)
from exporters.program.weights import structure_namespace, tag_weights_by_data_file
from exporters.stages.pipeline import Stage

log = logging.getLogger("exporters")


def count_delegates(edge: Any, aliases: dict[str, str]) -> dict[str, int]:
    """Delegated partitions per method, aliases included (they are emitted from their source's graph)."""
    counts = {}
    for name in edge.methods:
        graph = edge.exported_program(name).graph
        counts[name] = sum(1 for n in graph.nodes if n.op == "call_function" and "call_delegate" in str(n.target))
    return {**counts, **{alias: counts[source] for alias, source in aliases.items()}}


def with_progress(found: list[Any], methods: list[str], backend: str, clock: LoweringClock) -> list[Any]:
    """The partitioners, each reporting on the console as it partitions a method (lowering takes minutes), and telling
    ``clock`` which method ExecuTorch converts and how long each partitioning takes."""
    from executorch.exir.backend.partitioner import Partitioner, PartitionResult

    class Reporting(Partitioner):
        """Forwards to ``inner``; ExecuTorch asks each partitioner about each method in ``methods`` order, first
        before decomposing it (``transform_for_pre_decomposition``), then to ``partition`` it."""

        def __init__(self, inner: Partitioner, first: bool) -> None:
            super().__init__(getattr(inner, "spec", {}))
            self.inner, self.first = inner, first
            self.calls = self.converted = 0

        def ops_to_not_decompose(self, program: Any) -> Any:
            return self.inner.ops_to_not_decompose(program)

        def transform_for_pre_decomposition(self, program: Any) -> Any:
            if self.first and self.converted < len(methods):
                clock.converting(methods[self.converted])
            self.converted += 1
            return self.inner.transform_for_pre_decomposition(program)

        def partition(self, program: Any) -> PartitionResult:
            name = methods[self.calls] if self.calls < len(methods) else f"method {self.calls + 1}"
            self.calls += 1
            started = time.perf_counter()
            result = self.inner.partition(program)
            clock.partitioned(name, time.perf_counter() - started, len(result.partition_tags))
            log.info("  lower: %s partitioned (%d/%d): %d partition(s) for %s", name, self.calls, len(methods),
                     len(result.partition_tags), backend)
            if self.calls == len(methods):
                log.info("  lower: the backend compiles the partitions of every method together ...")
            return result

    return [Reporting(p, first=i == 0) for i, p in enumerate(found)]


@contextlib.contextmanager
def lowering_shortcuts(enabled: bool, backend: Backend) -> Iterator[None]:
    """Lowering's shortcuts through private internals (exporters.program.internals), or ExecuTorch's stock path: the same
    program bytes either way (tests/test_export.py). With them, torch.export collects the operators it may keep once,
    lowering's passes propagate shapes through torchao's quant ops without running their bodies, each method is
    decomposed once rather than three times and skips the edge dialect's passes that have nothing to act on in it, a
    weight packed for several methods is held once, nothing keeps a lowered graph (and through it the whole program)
    alive afterwards, and the backend takes its own (XNNPACK's preprocess copies one partition at a time and runs only
    the passes whose ops the partition holds)."""
    if not enabled:
        yield
        return
    with contextlib.ExitStack() as stack:
        for shortcut in (cia_ops_collected_once, torchao_quant_ops_shape_only, edge_programs_decomposed_once,
                         edge_passes_only_where_they_apply, *backend.lowering_shortcuts, named_data_stored_once,
                         lowering_forgets_graphs):
            stack.enter_context(shortcut())
        yield


class LowerStage(Stage):
    name = "lower"
    after = ("capture",)

    def run(self, captured: CapturedMethods, ctx: ExportContext) -> LoweredProgram:
        from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

        model, methods, undelegated, programs = captured.model, captured.methods, captured.undelegated, captured.programs
        components, models = captured.components, self.models_of(captured)
        del captured  # to_edge_transform_and_lower rewrites the programs: nothing may use them after it
        plan, backend = self.plan, self.plan.backend
        found = parts(plan)
        constants: dict[str, Any] = {}
        for part in found:  # the runners' constants (the decoder's), then what each other part adds
            constants.update(part.kind.constants(part, ctx, models))
        external = plan.weights == WeightsPlacement.external
        # External weights: every constant is marked for its data file (the base's, or its adapter's) before
        # partitioning, and the backend names its weights by tensor rather than by content, so the program is the same
        # bytes whatever the weights. Then each part's own passes.
        passes = ([tag_weights_by_data_file()] if external else []) + [
            p for part in found for p in part.kind.passes(part)]
        delegate = BACKENDS[backend.partitioner]
        naming = (delegate.weights_by_name(structure_namespace(programs)) if external and delegate.weights_by_name
                  else contextlib.nullcontext())
        clock, started = LoweringClock(), time.perf_counter()
        with naming, lowering_shortcuts(plan.shortcuts, delegate), clock.running(), convolutions_unguarded():
            edge = to_edge_transform_and_lower(
                programs,
                transform_passes=passes or None,
                partitioner=with_progress(partitioners(backend.partitioner, backend.options), list(programs),
                                          backend.name, clock),
                constant_methods=constants,
                # torchao's quantized ops are not core ATen; the backend consumes them.
                compile_config=EdgeCompileConfig(_check_ir_validity=False),
            )
        ctx.lowering = clock.times(time.perf_counter() - started)
        del programs
        log.info("  lower: %s", ctx.lowering.describe())
        # Aliases (forward = prefill) are not lowered: emit writes their source's execution plan under their name.
        return LoweredProgram(model=model, methods=methods, edge=edge, constant_methods=constants,
                              delegated_partitions=count_delegates(edge, methods.aliases), undelegated=undelegated,
                              components=components)
