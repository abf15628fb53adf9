"""Lowering passes more than one kind of model needs (after ``to_edge``, before partitioning)."""

from __future__ import annotations

from typing import Any


def noop_expands_dropped() -> Any:
    """A pass (after ``to_edge``, before partitioning) replacing each ``expand_copy`` to its input's own shape by its
    input. Eager attention (transformers' 4-D ``matmul``: the vision towers', Whisper's) traces to such expands, which
    XNNPACK does not take: each ended the layer's partition and copied its input on the portable kernels, one of
    them the ``[heads, P, P]`` attention probabilities (1 GB per layer at Gemma 3's 896 px; 8 ms of a Whisper base
    decoder step, its stored keys and values copied at every call)."""
    from executorch.exir.dialects._ops import ops as exir_ops
    from executorch.exir.pass_base import ExportedProgramPassBase, ExportedProgramPassResult

    expand = exir_ops.edge.aten.expand_copy.default

    class NoopExpandsDropped(ExportedProgramPassBase):
        def call(self, exported_program: Any) -> ExportedProgramPassResult:
            graph, dropped = exported_program.graph, 0
            for node in list(graph.nodes):
                if node.target == expand and tuple(node.args[0].meta["val"].shape) == tuple(node.meta["val"].shape):
                    node.replace_all_uses_with(node.args[0])
                    graph.erase_node(node)
                    dropped += 1
            exported_program.graph_module.recompile()
            return ExportedProgramPassResult(exported_program, dropped > 0)

    return NoopExpandsDropped()
