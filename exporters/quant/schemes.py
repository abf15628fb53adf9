"""Quantization schemes: names used in ``conf/quant/*.yaml`` mapped to torchao configs and dtypes.

Applied to the eager model with torchao's ``quantize_`` before capture (a source transform), so the
quantized eager model is also the reference the runtime output is validated against. Three
independent choices: the dtype of everything left in floating point, the scheme of the linear
layers (``lm_head`` may have its own), and the scheme of the token embedding.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, is_dataclass
from typing import Any, Callable

import torch
from torch import nn

from exporters.config import QuantConfig
from exporters.quant.hqq import hqq_by_rows
from exporters.manifest import AppliedQuantization, AppliedScheme

log = logging.getLogger("exporters")

TorchaoConfigFactory = Callable[[int, str], Any]  # (group size, torchao qparams algorithm) -> config

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LINEAR_SCHEMES: dict[str, TorchaoConfigFactory] = {}
EMBEDDING_SCHEMES: dict[str, TorchaoConfigFactory] = {}
# How integer scales are chosen (``quant.qparams``): torchao's IntxChooseQParamsAlgorithm values.
# "hqq" (half-quadratic, scale only) is what ExecuTorch's export_llm uses; "affine" is plain min/max.
QPARAMS: dict[str, str] = {"hqq": "hqq_scale_only", "affine": "affine"}
# Group sizes a layer may fall back to must be multiples of this (XNNPACK's blockwise kernels need it;
# its 4-bit kernels treat one scale per row as one group of the whole width, so that width too).
GROUP_SIZE_QUANTUM = 32
# 4-bit schemes whose kernels cannot take a layer of this width at all fall back to their 8-bit form.
EIGHT_BIT_FORM = {"8da4w": "8da8w", "4w": "8w"}


def _register(table: dict[str, TorchaoConfigFactory], name: str) -> Callable[[TorchaoConfigFactory], TorchaoConfigFactory]:
    def wrap(fn: TorchaoConfigFactory) -> TorchaoConfigFactory:
        table[name] = fn
        return fn

    return wrap


def _granularity(group_size: int) -> Any:
    from torchao.quantization.granularity import PerAxis, PerGroup

    return PerAxis(0) if group_size == 0 else PerGroup(group_size)


def _dynamic_activation(weight_dtype: torch.dtype, group_size: int, algorithm: str) -> Any:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig

    return Int8DynamicActivationIntxWeightConfig(weight_dtype=weight_dtype, weight_granularity=_granularity(group_size),
                                                 intx_choose_qparams_algorithm=algorithm)


def _weight_only(weight_dtype: torch.dtype, group_size: int, algorithm: str) -> Any:
    from torchao.quantization import IntxWeightOnlyConfig

    return IntxWeightOnlyConfig(weight_dtype=weight_dtype, granularity=_granularity(group_size),
                                intx_choose_qparams_algorithm=algorithm)


@_register(LINEAR_SCHEMES, "8da4w")
def int8_dynamic_act_int4_weight(group_size: int, algorithm: str) -> Any:
    return _dynamic_activation(torch.int4, group_size, algorithm)


@_register(LINEAR_SCHEMES, "8da8w")
def int8_dynamic_act_int8_weight(group_size: int, algorithm: str) -> Any:
    return _dynamic_activation(torch.int8, group_size, algorithm)


@_register(LINEAR_SCHEMES, "4w")
@_register(EMBEDDING_SCHEMES, "4w")
def int4_weight_only(group_size: int, algorithm: str) -> Any:
    return _weight_only(torch.int4, group_size, algorithm)


@_register(LINEAR_SCHEMES, "8w")
@_register(EMBEDDING_SCHEMES, "8w")
def int8_weight_only(group_size: int, algorithm: str) -> Any:
    return _weight_only(torch.int8, group_size, algorithm)


def group_size_for(width: int, requested: int) -> int:
    """``requested`` if it divides ``width``; else the largest smaller multiple of 32 that does; else 0 (per row)."""
    if requested == 0 or width % requested == 0:
        return requested
    fallbacks = range(requested - requested % GROUP_SIZE_QUANTUM, 0, -GROUP_SIZE_QUANTUM)
    return next((g for g in fallbacks if g < requested and width % g == 0), 0)


def layer_scheme(scheme: str, width: int, requested: int) -> tuple[str, int]:
    """The scheme and group size a layer of ``width`` gets: the nearest to what was asked that kernels run."""
    group = group_size_for(width, requested)
    if group == 0 and width % GROUP_SIZE_QUANTUM and scheme in EIGHT_BIT_FORM:
        return EIGHT_BIT_FORM[scheme], 0
    return scheme, group


def _describe_choice(scheme: str, group: int) -> str:
    return f"{scheme}, " + ("one scale per row" if group == 0 else f"group size {group}")


def _describe(config: Any) -> dict[str, Any]:
    fields = asdict(config) if is_dataclass(config) else dict(vars(config))
    return {k: v if isinstance(v, (int, float, bool, str, type(None))) else str(v) for k, v in fields.items()}


def _apply(model: nn.Module, table: dict[str, TorchaoConfigFactory], scheme: str, group_size: int, qparams: str,
           modules: dict[str, nn.Module], width: Callable[[nn.Module], int], notes: list[str]) -> AppliedScheme:
    """Quantize ``modules`` with ``scheme``; a layer the group size does not fit gets the nearest choice that does."""
    from torchao.quantization import quantize_

    chosen = {name: layer_scheme(scheme, width(m), group_size) for name, m in modules.items()}
    for choice in sorted(set(chosen.values())):
        targets = {modules[n] for n, c in chosen.items() if c == choice}
        with hqq_by_rows():
            quantize_(model, table[choice[0]](choice[1], QPARAMS[qparams]), filter_fn=lambda m, fqn: m in targets)
    fallbacks = {n: _describe_choice(*c) for n, c in sorted(chosen.items()) if c != (scheme, group_size)}
    for what in sorted(set(fallbacks.values())):
        names = [n for n, w in fallbacks.items() if w == what]
        note = (f"{scheme}: group size {group_size} does not divide the width of {len(names)} layer(s) "
                f"({names[0]}: {width(modules[names[0]])}); they use {what}")
        log.info(note)
        notes.append(note)
    config = table[scheme](group_size, QPARAMS[qparams])
    return AppliedScheme(scheme, type(config).__name__, _describe(config),
                         {n: c[1] for n, c in sorted(chosen.items())}, fallbacks)


def quantize_model(model: nn.Module, cfg: QuantConfig) -> AppliedQuantization:
    """Cast to ``cfg.dtype`` then quantize linears, ``lm_head`` and the embedding in place.

    The checkpoint's own dtype (often bf16) is kept through loading, so this cast is the only point
    where a second copy of the weights can exist.
    """
    dtype, linear, group_size, qparams = cfg.dtype, cfg.linear, cfg.group_size, cfg.qparams
    lm_head, lm_head_group_size = cfg.lm_head, cfg.lm_head_group_size
    embedding, embedding_group_size = cfg.embedding, cfg.embedding_group_size
    if any(p.dtype != DTYPES[dtype] for p in model.parameters()):
        model.to(DTYPES[dtype])
        model.init_buffers()  # KV caches in the model's dtype (fp32 where the attention kernels need it)
    applied = AppliedQuantization(dtype=dtype)
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = head is not None and embed is not None and head.weight is embed.weight
    if tied and (lm_head, lm_head_group_size) != (embedding, embedding_group_size):
        # The shared matrix cannot be stored two ways at once: give lm_head its own copy first.
        head.weight = nn.Parameter(embed.weight.detach().clone())
        applied.untied_embeddings = True
        applied.notes.append(
            f"tied embedding untied: lm_head quantized as {lm_head or dtype}, embedding as {embedding or dtype}"
        )
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    # Linears first: each one's fp32 weight is freed as it is quantized, so the embedding (the largest single
    # matrix, whose HQQ pass holds about four fp32 copies of it at once) is quantized beside int8 linears
    # rather than the whole fp32 model. Llama-3.2-1B shape, 8da4w_emb4w: this stage's peak 9.4 -> 6.8 GB.
    if linear and linears:
        applied.linear = _apply(model, LINEAR_SCHEMES, linear, group_size, qparams, linears,
                                lambda m: m.in_features, applied.notes)
    if embedding:
        applied.embedding = _apply(model, EMBEDDING_SCHEMES, embedding, embedding_group_size, qparams,
                                   {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding)},
                                   lambda m: m.embedding_dim, applied.notes)
        if tied and not applied.untied_embeddings:
            head.weight = embed.weight  # one quantized tensor serves both
            applied.notes.append(f"tied embedding kept tied: both quantized as {embedding}")
    if lm_head and head is not None and not (tied and not applied.untied_embeddings):
        applied.lm_head = _apply(model, LINEAR_SCHEMES, lm_head, lm_head_group_size, qparams, {"lm_head": head},
                                 lambda m: m.in_features, applied.notes)
    if hasattr(model, "tied_head"):  # the decoder computes logits from the embedding's matrix only if plain
        model.tied_head = tied and not applied.untied_embeddings and not embedding
    return applied


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
    import operator

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
