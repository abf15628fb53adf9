"""Lower: every method and the constant methods into ONE EdgeProgramManager, in one call.

``to_edge_transform_and_lower`` with a dict of programs runs ExecuTorch's multi-method ``to_backend``:
the backend preprocesses all methods together and stores each weight once (XNNPACK's NamedDataStore
keys constants by the sha256 of their bytes).
"""

from __future__ import annotations

from typing import Any

from exporters.stages.artifacts import CapturedMethods, LoweredProgram
from exporters.program.backends import partitioners
from exporters.config import BackendConfig
from exporters.stages.pipeline import Stage


def constant_methods(captured: CapturedMethods, max_seq_len: int, dynamic_shapes: bool) -> dict[str, Any]:
    """The metadata methods ExecuTorch's LLM runner reads, plus our own for custom runners."""
    args = captured.quantized.model.args
    ckpt = captured.quantized.loaded.checkpoint
    values: dict[str, Any] = {
        "get_max_seq_len": max_seq_len,
        "get_max_context_len": max_seq_len,
        "get_vocab_size": args.vocab_size,
        "get_n_layers": args.num_hidden_layers,
        "use_kv_cache": True,
        "enable_dynamic_shape": dynamic_shapes,
    }
    if ckpt.bos_id is not None:
        values["get_bos_id"] = ckpt.bos_id
    if ckpt.eos_ids:
        values["get_eos_ids"] = list(ckpt.eos_ids)
    for name, spec in captured.specs.items():
        values[f"get_{name}_max_tokens"] = spec.max_tokens
    return values


def count_delegates(edge: Any, aliases: dict[str, str]) -> dict[str, int]:
    """Delegated partitions per method, aliases included (they are emitted from their source's graph)."""
    counts = {}
    for name in edge.methods:
        graph = edge.exported_program(name).graph
        counts[name] = sum(1 for n in graph.nodes if n.op == "call_function" and "call_delegate" in str(n.target))
    return {**counts, **{alias: counts[source] for alias, source in aliases.items()}}


class LowerStage(Stage):
    name = "lower"

    def __init__(self, backend_cfg: BackendConfig, max_seq_len: int) -> None:
        self.cfg = backend_cfg
        self.max_seq_len = max_seq_len

    def run(self, captured: CapturedMethods) -> LoweredProgram:
        from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

        constants = constant_methods(captured, self.max_seq_len, self.cfg.dynamic_shapes)
        edge = to_edge_transform_and_lower(
            captured.programs,
            partitioner=partitioners(self.cfg.partitioner, self.cfg.options),
            constant_methods=constants,
            # torchao's quantized ops are not core ATen; the backend consumes them.
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
        )
        captured.programs = {}  # rewritten by the call above; do not reuse
        # Aliases (forward = prefill) are not lowered: emit writes their source's execution plan under their name.
        return LoweredProgram(captured=captured, edge=edge, constant_methods=constants,
                              delegated_partitions=count_delegates(edge, captured.aliases))
