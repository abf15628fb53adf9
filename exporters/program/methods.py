"""Methods are data: each exported method is a name, what it computes and how many tokens a call takes.

The decoder's methods call the same module with the same signature ``(tokens[1, T], input_pos[1])``; they
differ only in how many tokens they accept, so they capture the same weights and KV-cache buffers. The export
plan (``exporters.plan``) resolves a component's :class:`MethodTable` once; capture, lower, validate and finalize
read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import torch
from torch.export import Dim

from exporters.config import LayoutName
from exporters.errors import UserError, check_choice
from exporters.program.adapters import adapter_method
from exporters.program.lengths import Lengths
from exporters.program.layouts import LAYOUTS, Layout, check_layout
from models.gemma4_drafter import is_assistant_folder

if TYPE_CHECKING:
    from exporters.config import BackendConfig, DraftConfig, ExportConfig, ExportSection, QuantConfig
    from exporters.program.swappable import SlotPlan


MethodInput = Literal["tokens", "embeddings", "pixels", "features", "frames"]
MethodOutput = Literal["logits", "embeddings"]


@dataclass(frozen=True)
class MethodSpec:
    """What a method computes and how many tokens a call takes: plain data, decided once in the export plan."""

    kind: str  # prefill, decode, forward or verify: what the method computes (its name depends on the layout)
    min_tokens: int
    max_tokens: int
    dynamic: bool  # a token dimension of any length in [min_tokens, max_tokens] (else exactly max_tokens)
    # The logits of every position [1, T, V] (verify), else of the last one [1, V]: captured within the model's
    # logits_of_every_position, so the method's inputs stay the tokens and the position.
    full_logits: bool = False
    # What a call takes and gives (a vision-language program's methods, as ExecuTorch's MultimodalRunner calls them):
    # token_embedding takes tokens alone and gives their embeddings [1, T, hidden]; text_decoder takes embeddings
    # [1, T, hidden] (of text or of an image) and a position.
    takes: MethodInput = "tokens"
    gives: MethodOutput = "logits"
    image_size: int = 0  # vision_encoder: it takes one image [1, 3, image_size, image_size]
    # audio_encoder: it takes log-mel windows [W, bins, frames], W in [min_tokens, max_tokens] (the windows are its
    # dynamic dimension)
    features: tuple[int, int] = (0, 0)
    # audio_encoder of one recording (takes "frames", Gemma 4): [1, bins, frames_per_token * m] log-mel frames, m in
    # [min_tokens, max_tokens] positions
    bins: int = 0
    frames_per_token: int = 0
    # Granite Speech: [1, frames, bins] (frames_axis 1), any number of frames up to any_frames
    frames_axis: int = 2
    any_frames: int = 0

    @property
    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        """Example inputs of a method that takes tokens (:meth:`inputs_for` is every method's)."""
        assert self.takes == "tokens", f"{self.kind} takes {self.takes}: use inputs_for(width, dtype)"
        return self.inputs_for(0, torch.float32)

    def inputs_for(self, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Example inputs for ``torch.export``: a dynamic method's have 2 tokens (1 would let torch.export specialise
        the dimension to a constant); embeddings are ``width`` wide (the decoder's ``embedding_width``) in its
        activation ``dtype``."""
        if self.takes == "pixels":
            return (torch.zeros(1, 3, self.image_size, self.image_size),)
        n = min(2, self.max_tokens) if self.dynamic else self.max_tokens
        if self.takes == "features":
            return (torch.zeros(n, *self.features),)
        if self.takes == "frames":
            frames = self.frames_per_token * n
            return (torch.zeros(1, frames, self.bins) if self.frames_axis == 1 else torch.zeros(1, self.bins, frames),)
        position = torch.tensor([0], dtype=torch.int64)
        if self.takes == "embeddings":
            return torch.zeros(1, n, width, dtype=dtype), position
        tokens = torch.zeros(1, n, dtype=torch.int64)
        return (tokens,) if self.gives == "embeddings" else (tokens, position)

    @property
    def dynamic_shapes(self) -> Any:
        if not self.dynamic:
            return None
        if self.takes == "features":
            return ({0: Dim("windows", min=self.min_tokens, max=self.max_tokens)},)
        if self.takes == "frames" and self.any_frames:
            return ({self.frames_axis: Dim("audio_frames", min=1, max=self.any_frames)},)
        if self.takes == "frames":
            return ({2: self.frames_per_token * Dim("audio_positions", min=self.min_tokens, max=self.max_tokens)},)
        tokens = {1: Dim("num_tokens", min=self.min_tokens, max=self.max_tokens)}
        return (tokens,) if self.gives == "embeddings" else (tokens, None)

    @property
    def shape(self) -> "MethodShape":
        return MethodShape(self.kind, self.min_tokens, self.max_tokens)


@dataclass(frozen=True)
class MethodShape:
    """What a driver needs to know of a method: what it computes and how many tokens a call takes."""

    kind: str
    min_tokens: int
    max_tokens: int


def _many_tokens(kind: str, lengths: Lengths) -> MethodSpec:
    """Prompt processing: dynamic T in [1, call_tokens], or a fixed chunk on static-shape backends."""
    chunk = lengths.prefill_chunk
    return MethodSpec(kind, 1, lengths.call_tokens, True) if chunk is None else MethodSpec(kind, chunk, chunk, False)


def prefill(lengths: Lengths) -> MethodSpec:
    return _many_tokens("prefill", lengths)


def forward(lengths: Lengths) -> MethodSpec:
    """What ExecuTorch's stock ``TextLLMRunner`` calls, for both prompt and generation."""
    return _many_tokens("forward", lengths)


def decode(lengths: Lengths) -> MethodSpec:
    return MethodSpec("decode", 1, 1, False)


def verify(lengths: Lengths) -> MethodSpec:
    """Speculative decoding's check: the last accepted token and up to K proposed ones at their positions, the logits
    of every position out, the cache written at all of them. A rejected token is rolled back by position alone: the
    next call writes over its slot, and no query attends past its own position (docs/speculative.md).

    Where the backend takes dynamic shapes, a call takes 2 to K + 1 tokens, so a runner proposes as many as pay
    (exporters.runtime.speculative.DraftLength) and never pads a short proposal; else exactly K + 1."""
    most = lengths.verify_tokens
    dynamic = lengths.prefill_chunk is None and most > 2
    return MethodSpec("verify", 2 if dynamic else most, most, dynamic, full_logits=True)


def token_embedding(lengths: Lengths) -> MethodSpec:
    """ExecuTorch's MultimodalRunner: the embeddings of a text segment (any length up to a call) or of one token."""
    return MethodSpec("token_embedding", 1, lengths.call_tokens, True, gives="embeddings")


def text_decoder(lengths: Lengths) -> MethodSpec:
    """ExecuTorch's MultimodalRunner: the decoder on embeddings (a text segment's, an image's, or one token's) placed
    at a position, the last position's logits out; the KV cache is the other methods' (shared by buffer name)."""
    return MethodSpec("text_decoder", 1, lengths.call_tokens, True, takes="embeddings")


METHOD_KINDS: dict[str, Callable[[Lengths], MethodSpec]] = {
    "prefill": prefill,
    "decode": decode,
    "forward": forward,
    "verify": verify,
    "token_embedding": token_embedding,
    "text_decoder": text_decoder,
}
#: The methods ExecuTorch's MultimodalRunner calls on the decoder (named so in every layout).
MULTIMODAL_METHODS = ("token_embedding", "text_decoder")


def check_runner_feeds(cfg: ExportConfig, lengths: Lengths, what: str, tokens: int, one: str) -> None:
    """An encoder beside the decoder (``one``: "an image", "a recording" of ``tokens`` positions): the MultimodalRunner
    feeds each text segment and each encoder output to text_decoder in one call of its own length, so the backend
    must take dynamic shapes and one call must hold the encoder's positions. ``what``: the checkpoint, named."""
    if not cfg.backend.dynamic_shapes:
        raise UserError(f"{what}, and backend={cfg.backend.name} exports fixed-size calls: ExecuTorch's "
                        f"MultimodalRunner feeds each text segment and each {one.split(' ', 1)[1]} to text_decoder in "
                        "one call of its own length. Use backend=xnnpack or backend=portable.")
    if tokens > lengths.call_tokens:
        raise UserError(f"{what}, and one call of text_decoder takes at most {lengths.call_tokens} tokens "
                        f"(export.max_seq_len): the MultimodalRunner feeds {one} in one call. Set "
                        f"export.max_seq_len={tokens + 1} or more (and export.max_context_len above it).")


def check_encoder_unbuilt(cfg: ExportConfig, what: str, prompts: str, program: str) -> None:
    """What an encoder's program does not build yet (``prompts``: "image", "audio"; ``program``: "a vision-language",
    "an audio-language"), refused by name. Gemma 4's assistant is not: it keeps no cache of its own and reads the
    decoder's, whatever fed them; a draft model would have to see the image or the recording too."""
    draft = None if cfg.draft.checkpoint is None or is_assistant_folder(cfg.draft.checkpoint) else cfg.draft.checkpoint
    for key, value, why in (
            ("quant.pt2e", cfg.quant.pt2e, "the backend's quantizer converts a graph that takes tokens"),
            ("draft.checkpoint", draft, f"speculative decoding of {prompts} prompts with a draft model is not built "
                                        "yet (Gemma 4's assistant is)"),
            ("model.adapters", cfg.model.adapters or None, f"adapters on {program} program are not built yet"),
            ("export.adapters", cfg.export.adapters if cfg.export.adapters != "methods" else None,
             f"adapters on {program} program are not built yet")):
        if value is not None:
            raise UserError(f"{what}, and {key}={value}: {why}. Export it without {key}.")


def with_verify(kinds: Sequence[str], draft: DraftConfig) -> list[str]:
    """The decoder's method kinds: ``export.methods``, and verify when a draft model proposes tokens for it."""
    return [*kinds, *(["verify"] if draft.checkpoint is not None and "verify" not in kinds else [])]


def method_specs(kinds: list[str], layout: Layout, lengths: Lengths) -> dict[str, MethodSpec]:
    """Program method name (as the layout names it) -> what that method is."""
    return {layout.name_of(kind): METHOD_KINDS[kind](lengths) for kind in kinds}


def same_graph_aliases(specs: dict[str, MethodSpec], adapter_of: dict[str, str | None]) -> dict[str, str]:
    """Methods whose graph is another's (same adapter, same token bounds: prefill and forward) -> that method.

    Such a method is captured and lowered once and emitted under both names: lowering is most of an
    export's time, and the emitter stores the identical delegate blobs and weights once anyway.
    """
    first: dict[tuple[Any, ...], str] = {}
    aliases = {}
    for name, spec in specs.items():
        key = (adapter_of.get(name), spec.min_tokens, spec.max_tokens, spec.dynamic, spec.full_logits, spec.takes,
               spec.gives)
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
    # The methods of the program's other components (the draft's), by method name -> component name; every method
    # not here is the decoder's.
    component_of: dict[str, str] = field(default_factory=dict)
    # export.adapters=swappable: the base's methods read LoRA slots of this size, which the program's set_adapter
    # method writes (exporters.program.swappable); the adapters given have no methods of their own.
    slots: SlotPlan | None = None

    @staticmethod
    def of(kinds: Sequence[str], layout: Layout, lengths: Lengths, adapters: Sequence[str] = (),
           share_graphs: bool = True, slots: SlotPlan | None = None,
           applied: dict[str, str] | None = None) -> "MethodTable":
        """The base methods as ``layout`` names them, then each adapter's (``<adapter>_<method>``) unless the adapters
        go into ``slots``; ``share_graphs=False`` captures every method on its own (the stock path: no renamed
        plans). ``applied``: base methods (by name) that compute with an adapter under their own name (Granite
        Speech's text_decoder, with its checkpoint's adapter for prompts with audio)."""
        base = method_specs(list(kinds), layout, lengths)
        specs, adapter_of = dict(base), dict.fromkeys(base)
        for name, adapter in (applied or {}).items():
            assert name in specs, f"{name} is not one of the decoder's methods {list(specs)}"
            adapter_of[name] = adapter
        for adapter in adapters if slots is None else ():
            for name, spec in base.items():
                specs[adapter_method(adapter, name)] = spec
                adapter_of[adapter_method(adapter, name)] = adapter
        return MethodTable(specs, adapter_of, same_graph_aliases(specs, adapter_of) if share_graphs else {},
                           slots=slots)

    @staticmethod
    def for_component(component: str, kinds: Sequence[str], lengths: Lengths) -> "MethodTable":
        """Another component's methods (the draft's), named ``<component>_<stock name>``: ``draft_prefill``,
        ``draft_decode_one_token``, whatever the decoder's layout."""
        specs = {adapter_method(component, name): spec
                 for name, spec in method_specs(list(kinds), LAYOUTS[LayoutName.stock], lengths).items()}
        return MethodTable(specs, dict.fromkeys(specs), {}, dict.fromkeys(specs, component))

    def with_component(self, other: "MethodTable") -> "MethodTable":
        """This table and another component's (:meth:`for_component`): the program's methods."""
        return dataclasses.replace(self, specs={**self.specs, **other.specs},
                                   adapter_of={**self.adapter_of, **other.adapter_of},
                                   aliases={**self.aliases, **other.aliases},
                                   component_of={**self.component_of, **other.component_of})

    def of_adapter(self, adapter: str | None) -> dict[str, MethodSpec]:
        """The specs of the decoder's methods that compute with ``adapter`` (None: the base)."""
        return {n: s for n, s in self.specs.items()
                if self.adapter_of.get(n) == adapter and n not in self.component_of}

    def of_component(self, component: str) -> dict[str, MethodSpec]:
        """The specs of another component's methods (the draft's)."""
        return {n: s for n, s in self.specs.items() if self.component_of.get(n) == component}

    @property
    def adapters(self) -> list[str]:
        return list(dict.fromkeys(a for a in self.adapter_of.values() if a is not None))

    @property
    def captured(self) -> list[str]:
        """The methods captured and lowered (aliases are emitted from their source's graph)."""
        return [name for name in self.specs if name not in self.aliases]

    def summary(self) -> str:
        # A base method computing with an adapter under its own name (Granite Speech's text_decoder), in the base's list.
        applied = {n: a for n, a in self.adapter_of.items() if a is not None and not n.startswith(f"{a}_")}
        base = ", ".join(f"{n}{'(dynamic)' if s.dynamic else ''}{f' = {self.aliases[n]}' if n in self.aliases else ''}"
                         f"{f' (with adapter {applied[n]})' if n in applied else ''}"
                         for n, s in self.specs.items() if n in applied or (
                             self.adapter_of.get(n) is None and n not in self.component_of))
        adapters = [a for a in self.adapters if a not in applied.values()]
        variants = sum(1 for n, a in self.adapter_of.items() if a in adapters)
        others = "".join(f"; {c}: {', '.join(self.of_component(c))}" for c in dict.fromkeys(self.component_of.values()))
        slots = f"; set_adapter ({self.slots.describe()})" if self.slots else ""
        return base + (f"; the same for adapter(s) {', '.join(adapters)} ({variants} methods)"
                       if adapters else "") + others + slots


def check_methods(ex: ExportSection, backend: BackendConfig, lengths: Lengths, draft: DraftConfig,
                  quant: QuantConfig) -> None:
    """The methods, their layout and their token bounds make a program something can run."""
    if not ex.methods:
        raise UserError("export.methods is empty: give at least one of " + ", ".join(sorted(METHOD_KINDS)) + ".")
    for method in ex.methods:
        check_choice("export.methods entry", method, sorted(METHOD_KINDS), "Fix export.methods.")
    if ex.max_context_len is not None and ex.max_context_len < ex.max_seq_len:
        raise UserError(
            f"export.max_context_len={ex.max_context_len} is below export.max_seq_len={ex.max_seq_len}: the cache "
            "must hold at least one call's tokens. Raise export.max_context_len, lower export.max_seq_len, or set "
            "export.max_context_len=null (the cache is then max_seq_len long)."
        )
    check_layout(ex.layout, ex.methods, backend.dynamic_shapes)
    multimodal = [m for m in ex.methods if m in MULTIMODAL_METHODS]
    if multimodal and not backend.dynamic_shapes:
        raise UserError(
            f"export.methods has {', '.join(multimodal)} and backend={backend.name} exports fixed-size calls: "
            "ExecuTorch's MultimodalRunner feeds each text segment or image in one call of its own length, and each "
            f"new token alone. Use a backend with dynamic shapes (xnnpack, portable), or leave {' and '.join(multimodal)} "
            "out of export.methods.")
    if multimodal and quant.pt2e is not None:
        raise UserError(
            f"export.methods has {', '.join(multimodal)} and quant.pt2e={quant.pt2e}: the backend's quantizer converts "
            "the prompt method's graph, which takes tokens, and text_decoder takes embeddings. Use a torchao scheme "
            "(quant=8da4w, ...) for a vision-language program.")
    if len(multimodal) == 1:
        missing = next(m for m in MULTIMODAL_METHODS if m not in multimodal)
        raise UserError(f"export.methods has {multimodal[0]} without {missing}: ExecuTorch's MultimodalRunner needs "
                        f"both (token_embedding gives text_decoder its embeddings). Add {missing} to export.methods.")
    most = lengths.call_tokens
    if not backend.dynamic_shapes and not (1 <= ex.prefill_chunk <= most):
        raise UserError(f"export.prefill_chunk={ex.prefill_chunk} must be between 1 and {most} "
                        "(export.max_seq_len, and below the cache length).")
    check_verify(ex, lengths, draft, quant)


def check_verify(ex: ExportSection, lengths: Lengths, draft: DraftConfig, quant: QuantConfig) -> None:
    """verify takes draft.tokens + 1 tokens in one call: no more than a call may write, which is what lets a ring
    cache roll back a rejected token by position (its slots keep room for one call's tokens beyond its window)."""
    verifies = "verify" in with_verify(ex.methods, draft)
    if verifies and draft.tokens > lengths.call_tokens - 1:
        raise UserError(
            f"draft.tokens={draft.tokens}: verify takes the last accepted token and draft.tokens proposals in one call, "
            f"at most {lengths.call_tokens} tokens here (export.max_seq_len, below the cache length), so "
            f"draft.tokens must be between 1 and {lengths.call_tokens - 1}. Lower draft.tokens or raise "
            "export.max_seq_len.")
    if verifies and quant.pt2e is not None:
        raise UserError(
            f"{'export.methods has verify' if 'verify' in ex.methods else 'draft.checkpoint adds verify'} and "
            f"quant.pt2e={quant.pt2e}: the backend's quantizer converts the prompt "
            "method's graph, which returns the last position's logits only, and verify needs every position's. Use a "
            "torchao scheme (quant=8da4w, ...) or leave verify out.")
