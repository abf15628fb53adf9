"""Apply a quant config to the eager model: dtype cast, then torchao's ``quantize_`` on linears, embedding, lm_head.

A source transform before capture, so the quantized eager model is also what validation compares the program
with ("eager"). The model is changed in place: a copy would double the peak memory of the largest models.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, is_dataclass
from typing import Any, Callable

from torch import nn

from exporters.config import QuantConfig, TiedEmbeddingStorage
from exporters.manifest import AppliedQuantization, AppliedScheme
from exporters.quant import tied
from exporters.quant.hqq import hqq_by_rows
from exporters.quant.schemes import (DTYPES, EMBEDDING_SCHEMES, LINEAR_SCHEMES, QPARAMS, TorchaoConfigFactory,
                                     describe_choice, layer_scheme)
from models.decoder import CausalLM
from models.lora import is_adapter_module

log = logging.getLogger("exporters")

# Progress lines while quantizing many layers (a 1B model's linears take a minute): one per this share.
PROGRESS_STEP = 0.25


def _describe(config: Any) -> dict[str, Any]:
    fields = asdict(config) if is_dataclass(config) else dict(vars(config))
    return {k: v if isinstance(v, (int, float, bool, str, type(None))) else str(v) for k, v in fields.items()}


def _progress(role: str, total: int) -> Callable[[], None]:
    """Called once per quantized layer; logs at every quarter of ``total`` when there are many layers."""
    done = 0
    marks = {max(1, round(total * k * PROGRESS_STEP)) for k in range(1, int(1 / PROGRESS_STEP))} if total >= 16 else set()

    def step() -> None:
        nonlocal done
        done += 1
        if done in marks:
            log.info("  quantize: %s %d/%d layers", role, done, total)

    return step


def _apply(model: nn.Module, role: str, table: dict[str, TorchaoConfigFactory], scheme: str, group_size: int,
           qparams: str, modules: dict[str, nn.Module], width: Callable[[nn.Module], int],
           notes: list[str]) -> AppliedScheme:
    """Quantize ``modules`` with ``scheme``; a layer the group size does not fit gets the nearest choice that does."""
    from torchao.quantization import quantize_

    chosen = {name: layer_scheme(scheme, width(m), group_size) for name, m in modules.items()}
    step = _progress(role, len(modules))
    for choice in sorted(set(chosen.values())):
        targets = {modules[n] for n, c in chosen.items() if c == choice}

        def selected(module: nn.Module, fqn: str) -> bool:
            if module in targets:
                step()
                return True
            return False

        with hqq_by_rows():
            quantize_(model, table[choice[0]](choice[1], QPARAMS[qparams]), filter_fn=selected)
    fallbacks = {n: describe_choice(*c) for n, c in sorted(chosen.items()) if c != (scheme, group_size)}
    for what in sorted(set(fallbacks.values())):
        names = [n for n, w in fallbacks.items() if w == what]
        note = (f"{scheme}: group size {group_size} does not divide the width of {len(names)} layer(s) "
                f"({names[0]}: {width(modules[names[0]])}); they use {what}")
        log.info(note)
        notes.append(note)
    config = table[scheme](group_size, QPARAMS[qparams])
    return AppliedScheme(scheme, type(config).__name__, _describe(config),
                         {n: c[1] for n, c in sorted(chosen.items())}, fallbacks)


def quantize_model(model: CausalLM, cfg: QuantConfig,
                   tied_storage: TiedEmbeddingStorage = TiedEmbeddingStorage.shared) -> AppliedQuantization:
    """Cast to ``cfg.dtype`` then quantize linears, the embedding and ``lm_head`` in place.

    The checkpoint's own dtype (often bf16) is kept through loading, so this cast is the only point where a
    second copy of the weights can exist.
    """
    if any(p.dtype != DTYPES[cfg.dtype] for p in model.parameters()):
        model.to(DTYPES[cfg.dtype])
        model.init_buffers()  # KV caches in the model's dtype (fp32 where the attention kernels need it)
    plan = tied.plan_tied_embedding(model, cfg, tied_storage)
    applied = AppliedQuantization(dtype=str(cfg.dtype), untied_embeddings=plan is tied.TiedEmbedding.UNTIED,
                                  tied_embedding=plan.value)
    head, embed = model.lm_head, model.model.embed_tokens
    if plan is tied.TiedEmbedding.UNTIED:  # one matrix cannot be stored two ways at once
        head.weight = nn.Parameter(embed.weight.detach().clone())
        applied.notes.append(tied.note(plan, cfg))  # type: ignore[arg-type]
    every_linear = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    # LoRA adapters' A and B (models.lora) stay in the model's dtype unless quant.adapters names a scheme.
    adapters = {n: m for n, m in every_linear.items() if is_adapter_module(n)}
    linears = {n: m for n, m in every_linear.items() if n not in adapters}
    # Linears first: each one's fp32 weight is freed as it is quantized, so the embedding (the largest single
    # matrix, whose HQQ pass holds about four fp32 copies of it at once) is quantized beside int8 linears
    # rather than the whole fp32 model (the stage's peak on a 1B model, docs/DESIGN.md 2c).
    if cfg.linear and linears:
        applied.linear = _apply(model, "linear", LINEAR_SCHEMES, cfg.linear, cfg.group_size, cfg.qparams, linears,
                                lambda m: m.in_features, applied.notes)
    if cfg.adapters and adapters:  # one scale per row: an adapter's rank (lora_B's width) is too small for groups
        applied.adapters = _apply(model, "adapters", LINEAR_SCHEMES, cfg.adapters, 0, cfg.qparams, adapters,
                                  lambda m: m.in_features, applied.notes)
    if cfg.embedding:
        applied.embedding = _apply(model, "embedding", EMBEDDING_SCHEMES, cfg.embedding, cfg.embedding_group_size,
                                   cfg.qparams, {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding)},
                                   lambda m: m.embedding_dim, applied.notes)
    if plan is tied.TiedEmbedding.QUANTIZED_ONCE:
        head.weight = embed.weight  # one quantized tensor serves both
    elif cfg.lm_head:
        applied.lm_head = _apply(model, "lm_head", LINEAR_SCHEMES, cfg.lm_head, cfg.lm_head_group_size, cfg.qparams,
                                 {"lm_head": head}, lambda m: m.in_features, applied.notes)
    model.tied_head = plan is tied.TiedEmbedding.SHARED
    if plan is not tied.TiedEmbedding.UNTIED and (n := tied.note(plan, cfg)):
        applied.notes.append(n)
    return applied
