"""A captured method's signature as the manifest records it: its inputs' and outputs' names, shapes and dtypes."""

from __future__ import annotations

from typing import Any

import torch

from exporters.manifest import Signature, TensorSpec


def _tensor_spec(value: Any, name: str, dim_name: str) -> TensorSpec:
    shape: list[int | str] = [d if isinstance(d, int) else dim_name for d in value.shape]
    return TensorSpec(name=name, shape=shape, dtype=str(value.dtype).removeprefix("torch."))


def signature(program: torch.export.ExportedProgram, dim_name: str = "num_tokens",
              embeddings_in: bool = False) -> Signature:
    """Input and output shapes/dtypes of a captured method; the dynamic token dim appears as ``dim_name``.
    ``embeddings_in``: its first input is embeddings (text_decoder), named so whatever the module calls it."""
    sig = program.graph_signature
    nodes = {n.name: n for n in program.graph.nodes}
    inputs = [_tensor_spec(nodes[name].meta["val"], "embeddings" if embeddings_in and i == 0 else name, dim_name)
              for i, name in enumerate(sig.user_inputs)]
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    outputs = output_node.args[0]
    user_outputs = [o for o in outputs[len(outputs) - len(sig.user_outputs):]]
    return Signature(inputs=inputs,
                     outputs=[_tensor_spec(o.meta["val"], f"output_{i}", dim_name) for i, o in enumerate(user_outputs)])
