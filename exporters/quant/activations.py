"""Quantize each activation once in a captured program, however many linears read it."""

from __future__ import annotations

import operator
from typing import Any

import torch

# The pure torchao ops of a dynamically quantized activation (choose scale, quantize, dequantize).
ACTIVATION_QUANT_OPS = frozenset({"torchao::choose_qparams_affine", "torchao::quantize_affine",
                                  "torchao::dequantize_affine"})


def _frozen(value: Any) -> Any:
    """A hashable form of an FX node's args (nodes compare by identity)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def share_activation_quantization(program: torch.export.ExportedProgram) -> int:
    """Quantize each activation once, however many linears read it; returns how many nodes were merged.

    torchao quantizes the input of every dynamically quantized linear on its own, so q/k/v (one input) and
    gate/up (another) each quantize the same tensor: in XNNPACK, three and two identical convert operators
    per layer in every decode step. The merged chain computes the same values (the ops are pure), and
    the XNNPACK partitioner takes one quantized activation feeding several linears.
    """
    def mergeable(node: torch.fx.Node) -> bool:
        target = node.target
        return node.op == "call_function" and (
            target is operator.getitem  # the (scale, zero_point) of a merged choose_qparams
            or isinstance(target, torch._ops.OpOverload) and target.name() in ACTIVATION_QUANT_OPS)

    graph = program.graph_module.graph
    first: dict[Any, torch.fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):  # topological order: a node's inputs are merged before it is keyed
        if not mergeable(node):
            continue
        key = (node.target, _frozen(node.args), _frozen(node.kwargs))
        if key in first:
            node.replace_all_uses_with(first[key])
            graph.erase_node(node)
            merged += 1
        else:
            first[key] = node
    if merged:
        program.graph_module.recompile()
    return merged
