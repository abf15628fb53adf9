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


def _many_tokens(kind: str, max_seq_len: int, dynamic: bool, chunk: int) -> MethodSpec:
    """Prompt processing: dynamic T in [1, max_seq_len - 1], or a fixed chunk on static-shape backends."""
    if not dynamic:
        return MethodSpec(kind, _inputs(chunk), None, chunk, chunk)
    max_tokens = max_seq_len - 1
    tokens = Dim("num_tokens", min=1, max=max_tokens)
    # Example with 2 tokens: 1 would let torch.export specialise the dimension to a constant.
    return MethodSpec(kind, _inputs(min(2, max_tokens)), ({1: tokens}, None), 1, max_tokens)


def prefill(max_seq_len: int, dynamic: bool, chunk: int) -> MethodSpec:
    return _many_tokens("prefill", max_seq_len, dynamic, chunk)


def forward(max_seq_len: int, dynamic: bool, chunk: int) -> MethodSpec:
    """What ExecuTorch's stock ``TextLLMRunner`` calls, for both prompt and generation."""
    return _many_tokens("forward", max_seq_len, dynamic, chunk)


def decode(max_seq_len: int, dynamic: bool, chunk: int) -> MethodSpec:
    return MethodSpec("decode", _inputs(1), None, 1, 1)


METHOD_KINDS: dict[str, Callable[[int, bool, int], MethodSpec]] = {
    "prefill": prefill,
    "decode": decode,
    "forward": forward,
}


def method_specs(kinds: list[str], layout: Layout, max_seq_len: int, dynamic: bool,
                 chunk: int) -> dict[str, MethodSpec]:
    """Program method name (as the layout names it) -> what that method is."""
    return {layout.name_of(kind): METHOD_KINDS[kind](max_seq_len, dynamic, chunk) for kind in kinds}


def check_methods(ex: ExportSection, backend: BackendConfig) -> None:
    """The methods, their layout and their token bounds make a program something can run."""
    if not ex.methods:
        raise UserError("export.methods is empty: give at least one of " + ", ".join(sorted(METHOD_KINDS)) + ".")
    for method in ex.methods:
        check_choice("export.methods entry", method, sorted(METHOD_KINDS), "Fix export.methods.")
    if ex.max_seq_len < 2:
        raise UserError(f"export.max_seq_len={ex.max_seq_len} is too small: use 2 or more.")
    check_layout(ex.layout, ex.methods, backend.dynamic_shapes)
    if not backend.dynamic_shapes and not (1 <= ex.prefill_chunk < ex.max_seq_len):
        raise UserError(
            f"export.prefill_chunk={ex.prefill_chunk} must be between 1 and export.max_seq_len - 1 "
            f"({ex.max_seq_len - 1})."
        )
