"""One way to drive an LLM program: the prompt through the prompt method, then one token per step.

Validation, generation, the benchmarks and the tests all call programs through :class:`Driver`, so the
choice of methods and the cutting of a prompt into calls exist once (gpt-fast's ``prefill`` /
``decode_one_token``). The methods share one KV cache: the runtime must share memory arenas between
them (``executorch.runtime`` does; see ``exporters.program.layouts`` for the stock runners).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from exporters.errors import UserError
from exporters.program.adapters import ADAPTERS_CONSTANT, split_method
from exporters.program.layouts import KIND_OF_NAME
from exporters.program.methods import MethodShape


class RunsMethods(Protocol):
    def run(self, method: str, *inputs: torch.Tensor) -> list[Any]: ...


@dataclass(frozen=True)
class MethodRoles:
    prompt: str  # runs the prompt
    step: str  # runs one new token
    prompt_max_tokens: int  # tokens one call of the prompt method takes at most
    prompt_fixed: bool  # static shape: a call takes exactly prompt_max_tokens
    verify: str | None = None  # checks speculative proposals: every position's logits
    verify_tokens: int = 0  # the most tokens one verify call takes (the last accepted one and the proposals)
    verify_min_tokens: int = 0  # the fewest (verify_tokens: a static shape, short proposals are padded)
    # token_embedding, when prompt and step are text_decoder: each call's tokens go through it first (how
    # ExecuTorch's MultimodalRunner drives a vision-language program's text).
    embed: str | None = None

    @staticmethod
    def choose(methods: dict[str, MethodShape]) -> "MethodRoles":
        """Prompt: prefill, else forward, else the one-token method; step: decode, else a dynamic prompt method;
        a program with none of them but token_embedding and text_decoder: those two (:meth:`through_embeddings`)."""
        by_kind = {shape.kind: name for name, shape in methods.items()}
        if not {"prefill", "decode", "forward"} & by_kind.keys() and {"token_embedding", "text_decoder"} <= by_kind.keys():
            return MethodRoles.through_embeddings(methods)
        step = next((by_kind[k] for k in ("decode", "forward", "prefill")
                     if k in by_kind and methods[by_kind[k]].min_tokens == 1), None)
        if step is None:
            raise UserError(
                f"the methods {sorted(methods)} cannot take one token at a time (static-shape prompt methods "
                "only), so nothing can generate or validate with them. Add decode to export.methods."
            )
        prompt = next((by_kind[k] for k in ("prefill", "forward") if k in by_kind), step)
        verify = by_kind.get("verify")
        bounds = (methods[verify].max_tokens, methods[verify].min_tokens) if verify else (0, 0)
        return MethodRoles(prompt, step, 0, False, verify, *bounds).with_prompt(prompt, methods[prompt])

    @staticmethod
    def through_embeddings(methods: dict[str, MethodShape]) -> "MethodRoles":
        """The prompt and each token through token_embedding, then text_decoder."""
        by_kind = {shape.kind: name for name, shape in methods.items()}
        decoder = by_kind["text_decoder"]
        return MethodRoles(decoder, decoder, methods[decoder].max_tokens, False, embed=by_kind["token_embedding"])

    def with_prompt(self, name: str, shape: MethodShape) -> "MethodRoles":
        """The same roles with another method for the prompt."""
        return dataclasses.replace(self, prompt=name, prompt_max_tokens=shape.max_tokens,
                                   prompt_fixed=shape.min_tokens == shape.max_tokens > 1)


def program_context_len(program: Any) -> int:
    """KV-cache positions of a loaded program: ``get_max_context_len``, else (older programs) ``get_max_seq_len``,
    the stock runner's own fallback."""
    names = program.method_names
    return int(program.constant("get_max_context_len" if "get_max_context_len" in names else "get_max_seq_len"))


def program_method_shapes(program: Any, adapter: str | None = None) -> dict[str, MethodShape]:
    """The LLM methods of a loaded program (``exporters.runtime.programs.LoadedProgram``), read from its constants:
    the base's, or with ``adapter`` that adapter's (``<adapter>_prefill``, ...)."""
    names = program.method_names
    dynamic = bool(program.constant("enable_dynamic_shape")) if "enable_dynamic_shape" in names else True
    context = program_context_len(program)
    shapes = {}
    for name in names:
        owner, base = split_method(name, KIND_OF_NAME)
        if owner != adapter or base not in KIND_OF_NAME:
            continue
        kind = KIND_OF_NAME[base]
        key, least = f"get_{name}_max_tokens", f"get_{name}_min_tokens"
        max_tokens = int(program.constant(key)) if key in names else (1 if kind == "decode" else context - 1)
        if least in names:  # verify on a dynamic-shape backend: 2..K+1 tokens
            min_tokens = int(program.constant(least))
        else:  # verify without it (a static shape, or exported before verify took fewer) takes exactly its tokens
            fixed = kind == "verify" or not dynamic
            min_tokens = 1 if kind == "decode" else max_tokens if fixed else 1
        shapes[name] = MethodShape(kind, min_tokens, max_tokens)
    where = getattr(program, "path", "the program")
    if not shapes and adapter is not None:
        known = str(program.constant(ADAPTERS_CONSTANT)) if ADAPTERS_CONSTANT in names else ""
        raise UserError(f"{where} has no adapter {adapter!r}: "
                        + (f"its adapters are {known.replace(',', ', ')}." if known else "it was exported without "
                           "adapters (model.adapters).") + " Leave adapter unset for the base model.")
    if not shapes:
        raise UserError(
            f"{where} has none of the methods "
            f"{', '.join(sorted(KIND_OF_NAME))}: it is not an LLM program this tool can drive."
        )
    return shapes


class Driver:
    """Feeds a program prompts and tokens; positions are the caller's (the cache is overwritten in place)."""

    def __init__(self, program: RunsMethods, roles: MethodRoles) -> None:
        self.program = program
        self.roles = roles
        per_token = getattr(program, "positions_per_token", None)
        self._per_token = per_token is not None and per_token(roles.prompt)

    def _positions(self, start: int, n: int) -> torch.Tensor:
        """The position input of a call of ``n`` tokens at ``start``: the start alone, or one per token."""
        return torch.arange(start, start + n) if self._per_token else torch.tensor([start])

    @staticmethod
    def of(program: Any, adapter: str | None = None) -> "Driver":
        """The program's base methods, or with ``adapter`` that adapter's."""
        return Driver(program, MethodRoles.choose(program_method_shapes(program, adapter)))

    def load(self) -> None:
        """Load the prompt and step methods now, so that no timed call pays for loading them."""
        load = getattr(self.program, "load", None)  # LoadedProgram loads lazily; captured programs need not
        if load is not None:
            load(self.roles.prompt, self.roles.step, *([self.roles.embed] if self.roles.embed else []))

    def prefill(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Logits after the last of ``tokens`` [1, T] placed at ``start``..: whole calls of the prompt
        method, and what a static-shape prompt method cannot take one token at a time. -> [1, V]"""
        r = self.roles
        length, pos, logits = tokens.shape[1], 0, None
        while length - pos >= (r.prompt_max_tokens if r.prompt_fixed else 1):
            n = r.prompt_max_tokens if r.prompt_fixed else min(r.prompt_max_tokens, length - pos)
            logits = self._call(r.prompt, tokens[:, pos:pos + n], start + pos)
            pos += n
        for p in range(pos, length):
            logits = self.decode_one_token(tokens[:, p:p + 1], start + p)
        assert logits is not None, "prefill needs at least one token"
        return logits.reshape(-1, logits.shape[-1])[-1:]

    def verify(self, tokens: list[int], position: int) -> torch.Tensor:
        """Every position's logits [T, V] of ``tokens`` (``roles.verify_min_tokens`` to ``verify_tokens`` of them)
        placed at ``position``.., through the verify method; the cache is written at each of those positions."""
        assert self.roles.verify is not None and self.roles.verify_min_tokens <= len(tokens) <= self.roles.verify_tokens
        logits = self.program.run(self.roles.verify, torch.tensor([tokens], dtype=torch.int64),
                                  self._positions(position, len(tokens)))[0]
        return logits.reshape(len(tokens), -1)

    def decode_one_token(self, token: torch.Tensor | int, position: int) -> torch.Tensor:
        """Logits after one token [1, 1] at ``position``. -> [1, V]"""
        tokens = torch.tensor([[token]]) if isinstance(token, int) else token.reshape(1, 1)
        return self._call(self.roles.step, tokens, position).reshape(1, -1)

    def _call(self, method: str, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """``method`` on ``tokens`` [1, T] (on their embeddings, through ``roles.embed``) placed at ``start``."""
        inputs = tokens if self.roles.embed is None else self.program.run(self.roles.embed, tokens)[0]
        return self.program.run(method, inputs, self._positions(start, tokens.shape[1]))[0]
