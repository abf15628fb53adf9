"""Components: the models a program holds, each with its own build, quantization, methods and state.

Every program holds the decoder; a draft (speculative decoding) and a vision encoder are components beside it; LoRA
adapters are variants of the decoder (its methods again with the adapter applied, or slots set at run time). These
are the plan's types; what each kind does at each stage is its module in ``exporters.components``
(docs/ARCHITECTURE.md, "Components"). Nothing re-derives a component's lengths, cache or methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from exporters.config import Attention, Choice, KvDType, ModelConfig, Source
from exporters.program.methods import MethodTable
from exporters.quant.plan import QuantPlan
from models.checkpoint import build_model, open_checkpoint
from models.sources import SOURCES
from models.vocabulary import frequent_tokens

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint
    from models.decoder import CausalLM


class ComponentKind(Choice):
    """What a component is."""

    decoder = "decoder"  # token ids in, logits out, a KV cache: the program's LLM methods
    draft = "draft"  # a smaller decoder with the target's tokenizer proposing tokens for verify (draft.checkpoint)
    # Gemma 4's assistant (draft.checkpoint=<its folder>): proposes tokens for verify from the decoder's own state
    # (exporters.components.assistant)
    assistant = "assistant"
    vision_encoder = "vision_encoder"  # an image in, embeddings for the decoder out; no state
    audio_encoder = "audio_encoder"  # log-mel windows in, embeddings for the decoder out; no state
    # A speech recognizer (Whisper): log-mel features through its encoder, tokens through its text decoder attending to
    # them; a program's main model in place of the decoder (exporters.components.speech)
    asr = "asr"


class Build(Protocol):
    """How a component's eager model is built (``ModelBuild``; the encoders' and speech model's: ``FolderBuild``)."""

    model: ModelConfig

    @property
    def source(self) -> Source: ...

    def checkpoint(self, work_dir: Path) -> "Checkpoint": ...

    def build(self, checkpoint: "Checkpoint", device: str = "cpu") -> Any: ...


@dataclass(frozen=True)
class FolderBuild:
    """A build that reads a Hugging Face folder as it is (a vision or audio encoder beside the decoder, a speech
    model): its weights unless ``model.random_init``. Subclasses add what they need and ``build``."""

    model: ModelConfig

    @property
    def source(self) -> Source:
        return self.model.source

    def checkpoint(self, work_dir: Path) -> "Checkpoint":
        return open_checkpoint(self.model.checkpoint, need_weights=not self.model.random_init)


@dataclass(frozen=True)
class StatePlan:
    """The state a component's methods share in the runtime: its KV cache (hybrid layers add theirs here)."""

    positions: int  # KV-cache positions (get_max_context_len)
    call_tokens: int  # most tokens one call writes (ring caches keep room for them)
    kv_dtype: KvDType
    attention_sink: int  # positions kept forever at the start of the cache (0: none)


@dataclass(frozen=True)
class HeadVocabulary:
    """The tokens a component's lm_head scores, when not all (draft.vocab: FR-Spec, models.vocabulary)."""

    size: int  # draft.vocab
    ranked_by: str | None  # draft.vocab_text: a text whose token counts rank them; None: the tokenizer's order


@dataclass(frozen=True)
class ModelBuild:
    """How a component's eager model is built: the one recipe load, advise, calibration and the memory estimate use."""

    model: ModelConfig  # where the checkpoint comes from, its family, random weights, arch overrides, adapters
    state: StatePlan
    attention: Attention  # a preference: a model the kernel cannot compute gets ATen attention (models.checkpoint)
    head: HeadVocabulary | None = None  # lm_head scores these tokens only (None: every token)
    keeps_final_hidden: bool = False  # each position's final hidden state kept as state (Gemma 4's assistant reads it)

    @property
    def source(self) -> Source:
        return self.model.source

    def checkpoint(self, work_dir: Path) -> "Checkpoint":
        """The checkpoint folder, opened (the tiny source writes one into ``work_dir`` first)."""

        return SOURCES[self.model.source](self.model, work_dir)

    def build(self, checkpoint: "Checkpoint", device: str = "cpu") -> "CausalLM":
        """The decoder with ``checkpoint``'s weights (or seeded random ones); on ``device="meta"`` its shapes alone."""

        s = self.state
        model = build_model(checkpoint, s.positions, family=self.model.family, random_init=self.model.random_init,
                            seed=self.model.seed, attention=self.attention, kv_dtype=s.kv_dtype,
                            attention_sink=s.attention_sink, call_tokens=s.call_tokens,
                            keeps_final_hidden=self.keeps_final_hidden, device=device)
        if self.head is not None:

            text = Path(self.head.ranked_by).expanduser() if self.head.ranked_by else None
            model.score_only(frequent_tokens(checkpoint, self.head.size, model.args.vocab_size, text))
        return model


@dataclass(frozen=True)
class Component:
    """One model of the program, with its own methods and state, lowered with the others into one program."""

    name: str  # also the prefix of its methods' names and of its buffers' (draft_prefill, draft.layers.0...)
    kind: ComponentKind
    build: Build
    quant: QuantPlan
    methods: MethodTable  # its methods by program name, adapters' included

    @property
    def is_decoder(self) -> bool:
        """The program's main model: its methods are unprefixed and its quantization and validation are the
        manifest's top-level ones."""
        return self.kind == ComponentKind.decoder

    @property
    def is_language_model(self) -> bool:
        """Tokens in, logits out, a KV cache (the decoder, a draft): baseline and validation score it on text."""
        return self.kind in (ComponentKind.decoder, ComponentKind.draft)

    @property
    def adapters(self) -> list[str]:
        """Its variants: LoRA adapters, each applied by methods of its own over the component's stored weights."""
        return list(self.build.model.adapters)
