"""Methods are data: each exported method is a name, example inputs and dynamic shapes.

All methods call the same module with the same signature ``(tokens[1, T], input_pos[1])``; they
differ only in how many tokens they accept, so they capture the same weights and KV-cache buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.export import Dim

from exporters.errors import UserError, check_choice
from exporters.program.layouts import Layout, check_layout

if TYPE_CHECKING:
    from exporters.config import BackendConfig, ExportSection


@dataclass(frozen=True)
class MethodSpec:
    kind: str  # prefill, decode or forward: what the method computes (its name depends on the layout)
    example_inputs: tuple[torch.Tensor, torch.Tensor]
    dynamic_shapes: Any
    min_tokens: int
    max_tokens: int

    @property
    def dynamic(self) -> bool:
        return self.dynamic_shapes is not None

    @property
    def shape(self) -> "MethodShape":
        return MethodShape(self.kind, self.min_tokens, self.max_tokens)


@dataclass(frozen=True)
class MethodShape:
    """What a driver needs to know of a method: what it computes and how many tokens a call takes."""

    kind: str
    min_tokens: int
    max_tokens: int


def _inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, num_tokens, dtype=torch.int64), torch.tensor([0], dtype=torch.int64)


def context_len(ex: ExportSection) -> int:
    """KV-cache positions of the program: ``export.max_context_len``, or ``export.max_seq_len`` when that is null."""
    return ex.max_context_len if ex.max_context_len is not None else ex.max_seq_len


def tokens_per_call(max_seq_len: int, max_context_len: int) -> int:
    """Most tokens one call of a dynamic prompt method takes: ``max_seq_len``, but below the cache length, so a
    prompt leaves room for one generated token (the stock runner requires prompt < get_max_context_len and feeds
    longer prompts in calls of get_max_seq_len tokens)."""
    return min(max_seq_len, max_context_len - 1)


def _many_tokens(kind: str, max_tokens: int, dynamic: bool, chunk: int) -> MethodSpec:
    """Prompt processing: dynamic T in [1, max_tokens], or a fixed chunk on static-shape backends."""
    if not dynamic:
        return MethodSpec(kind, _inputs(chunk), None, chunk, chunk)
    tokens = Dim("num_tokens", min=1, max=max_tokens)
    # Example with 2 tokens: 1 would let torch.export specialise the dimension to a constant.
    return MethodSpec(kind, _inputs(min(2, max_tokens)), ({1: tokens}, None), 1, max_tokens)


def prefill(max_tokens: int, dynamic: bool, chunk: int) -> MethodSpec:
    return _many_tokens("prefill", max_tokens, dynamic, chunk)


def forward(max_tokens: int, dynamic: bool, chunk: int) -> MethodSpec:
    """What ExecuTorch's stock ``TextLLMRunner`` calls, for both prompt and generation."""
    return _many_tokens("forward", max_tokens, dynamic, chunk)


def decode(max_tokens: int, dynamic: bool, chunk: int) -> MethodSpec:
    return MethodSpec("decode", _inputs(1), None, 1, 1)


METHOD_KINDS: dict[str, Callable[[int, bool, int], MethodSpec]] = {
    "prefill": prefill,
    "decode": decode,
    "forward": forward,
}


def method_specs(kinds: list[str], layout: Layout, max_tokens: int, dynamic: bool,
                 chunk: int) -> dict[str, MethodSpec]:
    """Program method name (as the layout names it) -> what that method is; ``max_tokens``: :func:`tokens_per_call`."""
    return {layout.name_of(kind): METHOD_KINDS[kind](max_tokens, dynamic, chunk) for kind in kinds}


def check_methods(ex: ExportSection, backend: BackendConfig) -> None:
    """The methods, their layout and their token bounds make a program something can run."""
    if not ex.methods:
        raise UserError("export.methods is empty: give at least one of " + ", ".join(sorted(METHOD_KINDS)) + ".")
    for method in ex.methods:
        check_choice("export.methods entry", method, sorted(METHOD_KINDS), "Fix export.methods.")
    if ex.max_seq_len < 2:
        raise UserError(f"export.max_seq_len={ex.max_seq_len} is too small: use 2 or more.")
    if ex.max_context_len is not None and ex.max_context_len < ex.max_seq_len:
        raise UserError(
            f"export.max_context_len={ex.max_context_len} is below export.max_seq_len={ex.max_seq_len}: the cache "
            "must hold at least one call's tokens. Raise export.max_context_len, lower export.max_seq_len, or set "
            "export.max_context_len=null (the cache is then max_seq_len long)."
        )
    check_layout(ex.layout, ex.methods, backend.dynamic_shapes)
    most = tokens_per_call(ex.max_seq_len, context_len(ex))
    if not backend.dynamic_shapes and not (1 <= ex.prefill_chunk <= most):
        raise UserError(f"export.prefill_chunk={ex.prefill_chunk} must be between 1 and {most} "
                        "(export.max_seq_len, and below the cache length).")
