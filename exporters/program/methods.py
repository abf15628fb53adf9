"""Methods are data: each exported method is a name, what it computes and how many tokens a call takes.

The decoder's methods call the same module with the same signature ``(tokens[1, T], input_pos[1])``; they
differ only in how many tokens they accept, so they capture the same weights and KV-cache buffers. The export
plan (``exporters.plan``) resolves a component's :class:`MethodTable` once; capture, lower, validate and finalize
read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch.export import Dim

from exporters.errors import UserError, check_choice
from exporters.program.adapters import adapter_method
from exporters.plan.lengths import Lengths
from exporters.program.layouts import Layout, check_layout

if TYPE_CHECKING:
    from exporters.config import BackendConfig, ExportSection


@dataclass(frozen=True)
class MethodSpec:
    """What a method computes and how many tokens a call takes: plain data, decided once in the export plan."""

    kind: str  # prefill, decode or forward: what the method computes (its name depends on the layout)
    min_tokens: int
    max_tokens: int
    dynamic: bool  # a token dimension of any length in [min_tokens, max_tokens] (else exactly max_tokens)

    @property
    def example_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        # A dynamic method's example has 2 tokens: 1 would let torch.export specialise the dimension to a constant.
        return _inputs(min(2, self.max_tokens) if self.dynamic else self.max_tokens)

    @property
    def dynamic_shapes(self) -> Any:
        if not self.dynamic:
            return None
        return ({1: Dim("num_tokens", min=self.min_tokens, max=self.max_tokens)}, None)

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


def _many_tokens(kind: str, max_tokens: int, dynamic: bool, chunk: int) -> MethodSpec:
    """Prompt processing: dynamic T in [1, max_tokens], or a fixed chunk on static-shape backends."""
    return MethodSpec(kind, 1, max_tokens, True) if dynamic else MethodSpec(kind, chunk, chunk, False)


def prefill(max_tokens: int, dynamic: bool, chunk: int) -> MethodSpec:
    return _many_tokens("prefill", max_tokens, dynamic, chunk)


def forward(max_tokens: int, dynamic: bool, chunk: int) -> MethodSpec:
    """What ExecuTorch's stock ``TextLLMRunner`` calls, for both prompt and generation."""
    return _many_tokens("forward", max_tokens, dynamic, chunk)


def decode(max_tokens: int, dynamic: bool, chunk: int) -> MethodSpec:
    return MethodSpec("decode", 1, 1, False)


METHOD_KINDS: dict[str, Callable[[int, bool, int], MethodSpec]] = {
    "prefill": prefill,
    "decode": decode,
    "forward": forward,
}


def method_specs(kinds: list[str], layout: Layout, max_tokens: int, dynamic: bool,
                 chunk: int) -> dict[str, MethodSpec]:
    """Program method name (as the layout names it) -> what that method is; ``max_tokens``: ``Lengths.call_tokens``."""
    return {layout.name_of(kind): METHOD_KINDS[kind](max_tokens, dynamic, chunk) for kind in kinds}


def same_graph_aliases(specs: dict[str, MethodSpec], adapter_of: dict[str, str | None]) -> dict[str, str]:
    """Methods whose graph is another's (same adapter, same token bounds: prefill and forward) -> that method.

    Such a method is captured and lowered once and emitted under both names: lowering is most of an
    export's time, and the emitter stores the identical delegate blobs and weights once anyway.
    """
    first: dict[tuple[Any, ...], str] = {}
    aliases = {}
    for name, spec in specs.items():
        key = (adapter_of.get(name), spec.min_tokens, spec.max_tokens, spec.dynamic)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


@dataclass(frozen=True)
class MethodTable:
    """A component's LLM methods: name -> what it computes, the adapter each applies, and which share a graph."""

    specs: dict[str, MethodSpec]
    # method name -> the adapter it applies (None: the base model).
    adapter_of: dict[str, str | None]
    # Methods that compute exactly what another one does (forward and prefill): captured and lowered once,
    # emitted under both names. method name -> the method it shares.
    aliases: dict[str, str]

    @staticmethod
    def of(kinds: Sequence[str], layout: Layout, call_tokens: int, dynamic: bool, chunk: int,
           adapters: Sequence[str] = (), share_graphs: bool = True) -> "MethodTable":
        """The base methods as ``layout`` names them, then each adapter's (``<adapter>_<method>``);
        ``share_graphs=False`` captures every method on its own (the stock path: no renamed plans)."""
        base = method_specs(list(kinds), layout, call_tokens, dynamic, chunk)
        specs, adapter_of = dict(base), dict.fromkeys(base)
        for adapter in adapters:
            for name, spec in base.items():
                specs[adapter_method(adapter, name)] = spec
                adapter_of[adapter_method(adapter, name)] = adapter
        return MethodTable(specs, adapter_of, same_graph_aliases(specs, adapter_of) if share_graphs else {})

    def of_adapter(self, adapter: str | None) -> dict[str, MethodSpec]:
        """The specs of the methods that compute with ``adapter`` (None: the base)."""
        return {n: s for n, s in self.specs.items() if self.adapter_of.get(n) == adapter}

    @property
    def adapters(self) -> list[str]:
        return list(dict.fromkeys(a for a in self.adapter_of.values() if a is not None))

    @property
    def captured(self) -> list[str]:
        """The methods captured and lowered (aliases are emitted from their source's graph)."""
        return [name for name in self.specs if name not in self.aliases]

    def summary(self) -> str:
        base = ", ".join(f"{n}{'(dynamic)' if s.dynamic else ''}{f' = {self.aliases[n]}' if n in self.aliases else ''}"
                         for n, s in self.of_adapter(None).items())
        adapters = self.adapters
        return base + (f"; the same for adapter(s) {', '.join(adapters)} ({len(self.specs) - len(self.of_adapter(None))} "
                       "methods)" if adapters else "")


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
    most = Lengths.of_section(ex, backend.dynamic_shapes).call_tokens
    if not backend.dynamic_shapes and not (1 <= ex.prefill_chunk <= most):
        raise UserError(f"export.prefill_chunk={ex.prefill_chunk} must be between 1 and {most} "
                        "(export.max_seq_len, and below the cache length).")
