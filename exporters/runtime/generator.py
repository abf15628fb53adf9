"""Text generation with an exported program: prompt in, streamed text out, tokens/s measured.

Works with whatever the program holds (``exporters.runtime.driver`` chooses the methods): either of our layouts,
``forward`` only (``export_llm``'s programs), fixed-size prefill chunks (static-shape backends), or a
one-token method alone.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from exporters.errors import UserError, check_choice
from exporters.manifest import AudioEntry, program_in
from exporters.program.adapters import ADAPTERS_CONSTANT
from exporters.program.audio import TEXT_DECODER_ADAPTER
from exporters.program.constants import DRAFT_VOCAB
from exporters.program.draft import ASSISTANT_METHOD, DRAFT, DRAFT_METHODS
from exporters.program.vision import VISION_METHOD
from exporters.program.weights import data_files_beside
from exporters.runtime.constraint import Constraint, Grammars
from exporters.runtime.driver import Driver, MethodRoles, program_context_len, program_method_shapes
from exporters.runtime.heard import audio_prompt
from exporters.runtime.images import image_prompt
from exporters.runtime.media import MediaPrompt, prefill_parts
from exporters.runtime.programs import LoadedProgram
from exporters.runtime.sampling import SamplingConfig, distribution, sample  # noqa: F401 (re-exported)
from exporters.runtime.speculative import (SPECULATIVE, AssistantProposer, DraftLength, DraftProposer, LookupProposer,
                                           Observers, Proposer, Speculation, SpeculationStats, StopReason, Stops,
                                           continue_text)
from exporters.runtime.swap import Slots, is_swappable
from models.errors import ModelError
from models.tokenizer import CHAT_TEMPLATE_FILE, TextTokenizer, find_tokenizer, load_tokenizer


@dataclass
class GenerationResult:
    text: str
    prompt_ids: list[int]
    new_ids: list[int]
    stop_reason: StopReason
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    speculation: SpeculationStats | None = None  # speculative decoding's numbers, when it ran


@dataclass
class Progress:
    """How far the latest generation went: read it when ``on_text`` stopped one by raising."""

    cached: int  # the prompt's first tokens the cache held already (not run again)
    new_ids: list[int] = field(default_factory=list)  # the tokens generated so far


def resolve_program(path: str | Path) -> Path:
    """A run folder (the program its manifest names) or a .pte file."""
    p = Path(path)
    pte = program_in(p) if p.is_dir() else p
    if not pte.is_file():
        missing = f"the folder has no {pte.name}" if p.is_dir() else "no such file"
        raise UserError(f"{path}: {missing}. Give a .pte file or the run folder of a finished export.")
    return pte


class TextStream:
    """Turns token ids into text pieces, holding back bytes until they form whole UTF-8 characters.

    Byte-level BPE splits non-ASCII characters across tokens; decoding one token at a time (as the
    stock runner's Python callback does) yields broken characters or raises.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its next byte
            return ""
        piece, self.emitted = text[len(self.emitted):], text
        return piece


def tokenizer_file(pte: Path, tokenizer: str | None) -> Path:
    """``tokenizer`` if given, else the tokenizer.json / tokenizer.model next to the program."""
    path = Path(tokenizer) if tokenizer else find_tokenizer(pte.parent)
    if path is None or not path.is_file():
        raise UserError(
            f"no tokenizer {'at ' + str(path) if path else 'next to ' + str(pte)}: pass "
            "tokenizer=/path/to/tokenizer.json (or a SentencePiece tokenizer.model)."
        )
    return path


def tokenizer_for(path: Path) -> TextTokenizer:
    try:
        return load_tokenizer(path)
    except ModelError as e:
        raise UserError(str(e)) from e


def chat_template(folder: Path) -> str | None:
    """The chat template beside a program: ``chat_template.jinja`` (how transformers saves it now), else the
    ``chat_template`` of ``tokenizer_config.json`` (older checkpoints)."""
    jinja, config_file = folder / CHAT_TEMPLATE_FILE, folder / "tokenizer_config.json"
    if jinja.is_file():
        return jinja.read_text()
    return json.loads(config_file.read_text()).get("chat_template") if config_file.is_file() else None


def chat_prompt(pte: Path, prompt: str) -> str:
    """Apply the model's chat template (see :func:`chat_template`) to one user message."""
    if not chat_template(pte.parent):
        raise UserError(f"chat=true needs a chat template ({CHAT_TEMPLATE_FILE}, or chat_template in "
                        f"tokenizer_config.json) in {pte.parent}; this model has none. Use chat=false.")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pte.parent), local_files_only=True)
    return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


class Generator:
    """A loaded program plus its metadata; ``generate`` may be called repeatedly (the cache is rewritten)."""

    def __init__(self, pte: str | Path, tokenizer: str | None = None, adapter: str | None = None,
                 load: bool = True, every_adapter: bool = False, keep_cache: bool = False) -> None:
        """``adapter``: generate with that LoRA adapter (``model.adapters`` at export: its methods; of a swappable
        program, also any ``.ptd`` or PEFT folder that fits, set with ``set_adapter``); None: the base. ``load``:
        load the methods now; False leaves it to :meth:`load`, so that a request can be checked first against what
        the program says without its weights (its methods and constants). ``every_adapter``: load every adapter's
        data file too, so that :meth:`use_adapter` can switch to any of them (a server). ``keep_cache``: remember
        what the cache holds, so that a prompt starting with those tokens (a chat's next turn) runs only the rest;
        only for a cache every position of which stays (no ring, no recurrent state: exporters.server.engine)."""
        start = time.perf_counter()
        self.pte = resolve_program(pte)
        # The base's data file and this adapter's only (export.weights=external), as an app loads them.
        self.program = LoadedProgram(self.pte, data_files_beside(
            self.pte, None if every_adapter else [adapter] if adapter else []))
        self.slots = Slots(self.program, self.pte.parent) if is_swappable(self.program) else None
        self.tokenizer_file = tokenizer_file(self.pte, tokenizer)
        self.tokenizer = tokenizer_for(self.tokenizer_file)
        names = self.program.method_names
        self.max_context_len = program_context_len(self.program)
        # export.attention_sink: the cache is a ring, so prompts and generation may run past its length.
        self.endless = bool(self.program.constant("attention_sink_size")) if "attention_sink_size" in names else False
        self.bos_id = self.program.constant("get_bos_id") if "get_bos_id" in names else None
        eos = self.program.constant("get_eos_ids") if "get_eos_ids" in names else []
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.driver = Driver.of(self.program, adapter if self.slots is None else None)
        self._drivers = {adapter: self.driver}  # by adapter (None: the base), each made once
        self.keep_cache = keep_cache
        self._in_cache: list[int] = []  # with keep_cache: the tokens the cache holds, from position 0
        self.progress = Progress(0)
        self._draft: Driver | None = None  # the draft model's methods, loaded when speculation first uses them
        self._grammars: Grammars | None = None
        self.adapter = adapter
        self.load_seconds = time.perf_counter() - start
        if load:
            self.load()

    def load(self) -> None:
        """Load the methods (XNNPACK packs each one's weights: minutes on a large model), so the rates measure
        running alone, and set the adapter of a swappable program."""
        start = time.perf_counter()
        self.driver.load()
        if self.slots is not None and self.adapter is not None:
            self.slots.set(self.adapter)
        self.load_seconds += time.perf_counter() - start

    def _reusable(self, ids: list[int]) -> int:
        """How many of ``ids``' first tokens the cache holds already (not the last: its logits are needed)."""
        n = 0
        for a, b in zip(self._in_cache, ids[:-1]):
            if a != b:
                break
            n += 1
        return n

    def use_adapter(self, adapter: str | None) -> None:
        """Generate with ``adapter`` from now on (None: the base): its methods, or set in a swappable program's
        slots. The cache then holds what another model wrote: the next prompt is run whole."""
        if adapter == self.adapter:
            return
        if self.slots is not None:
            self.slots.set(adapter)
        else:
            if adapter not in self._drivers:
                self._drivers[adapter] = Driver.of(self.program, adapter)
                self._drivers[adapter].load()
            self.driver = self._drivers[adapter]
        self.adapter = adapter
        self._in_cache = []

    @property
    def grammars(self) -> Grammars:
        """Constraints for this program's tokenizer and vocabulary (a JSON schema: :meth:`Grammars.json_schema`)."""
        if self._grammars is None:
            vocab = self.program.constant("get_vocab_size") if "get_vocab_size" in self.program.method_names else None
            json_file = self.tokenizer_file if self.tokenizer_file.suffix == ".json" else None
            self._grammars = Grammars(json_file, vocab, self.eos_ids)
        return self._grammars

    @property
    def adapters(self) -> list[str]:
        """The adapters the program was exported with, by name (its methods', or its swappable files')."""
        if self.slots is not None:
            return self.slots.exported()
        known = self.program.constant(ADAPTERS_CONSTANT) if ADAPTERS_CONSTANT in self.program.method_names else ""
        return [name for name in str(known).split(",") if name]

    def encode(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(prompt)
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def check_fits(self, ids: list[int]) -> None:
        if not ids:
            raise UserError("the prompt is empty and the model has no bos token: give a non-empty prompt.")
        if len(ids) >= self.max_context_len and not self.endless:
            raise UserError(
                f"the prompt is {len(ids)} tokens but the program's cache holds {self.max_context_len} "
                f"(get_max_context_len), leaving no room to generate. Shorten the prompt or re-export with a larger "
                f"export.max_context_len, or with export.attention_sink=4 to go on past the end of the cache."
            )

    @property
    def has_draft(self) -> bool:
        """The program holds a draft model's methods, or Gemma 4's assistant's."""
        names = set(self.program.method_names)
        return DRAFT_METHODS <= names or ASSISTANT_METHOD in names

    def check_speculation(self, speculative: str, draft_tokens: int | None = None) -> None:
        """Refuse a ``speculative`` mode the program cannot run, or ``draft_tokens`` more than its verify checks:
        from its methods and constants, before its weights are loaded."""
        check_choice("speculative", speculative, SPECULATIVE, "Use speculative=auto, draft, lookup or none.")
        if self.driver.roles.verify is not None:
            DraftLength.check(self.driver.roles.verify_tokens - 1, draft_tokens)
        if speculative == "draft" and not self.has_draft:
            lookup = (" or speculative=lookup (its verify method checks the text's own n-grams)"
                      if self.driver.roles.verify is not None else "")
            raise UserError(f"speculative=draft needs a draft model in the program, and {self.pte.name} has none: "
                            "export with draft.checkpoint=<a smaller model with the same tokenizer> (it adds verify "
                            f"too), or use speculative=none{lookup}.")
        if speculative == "lookup" and self.driver.roles.verify is None:
            raise UserError(f"speculative=lookup needs the program's verify method, and {self.pte.name} has none: "
                            "export with verify in export.methods (export.methods=[prefill,decode,forward,verify]) "
                            "or with a draft (draft.checkpoint=...), or use speculative=none.")

    def speculation(self, speculative: str, draft_tokens: int | None = None) -> Proposer | None:
        """What proposes tokens for the verify method: ``draft``, the program's draft model; ``lookup``, the text's
        own n-grams; ``auto``, the draft when the program holds one, else nothing; ``none``, nothing (one token per
        call). Refused as :meth:`check_speculation` says."""
        self.check_speculation(speculative, draft_tokens)
        if speculative == "lookup":
            return LookupProposer()
        if speculative == "draft" or (speculative == "auto" and self.has_draft and self.driver.roles.verify is not None):
            if ASSISTANT_METHOD in self.program.method_names:
                return AssistantProposer(self.program, ASSISTANT_METHOD)
            if self._draft is None:
                self._draft = Driver.of(self.program, DRAFT)
                self._draft.load()
            names = self.program.method_names
            return DraftProposer(self._draft, self.program.constant(DRAFT_VOCAB) if DRAFT_VOCAB in names else None)
        return None

    @property
    def sees_images(self) -> bool:
        """A vision-language program (it has vision_encoder)."""
        return VISION_METHOD in self.program.method_names

    def with_images(self, prompt: str, images: list[str], chat: bool = False) -> MediaPrompt:
        """``prompt`` and ``images`` (files) as the program's processor makes them (exporters.runtime.images)."""
        made = image_prompt(self.program, self.pte.parent, prompt, images, chat)
        self.check_fits(made.ids)
        return made

    def with_audio(self, prompt: str, audio: str, chat: bool = False, entry: AudioEntry | None = None,
                   images: Sequence[str] = ()) -> MediaPrompt:
        """``prompt`` and the recording ``audio`` (a file) for an audio-language program (exporters.runtime.heard),
        with ``images`` too where it also sees (Gemma 4); ``entry``: the manifest's record of its audio encoder (the
        audio token's text, the preprocessor)."""
        made = audio_prompt(self.program, self.pte.parent, prompt, audio, chat, self.encode, entry, images)
        self.check_fits(made.ids)
        return made

    def generate(self, prompt: str, cfg: SamplingConfig, on_text: Callable[[str], None] | None = None,
                 prompt_ids: list[int] | None = None, speculative: str = "auto",
                 draft_tokens: int | None = None, media: MediaPrompt | None = None,
                 on_logits: Callable[[torch.Tensor], None] | None = None,
                 constraint: Constraint | None = None) -> GenerationResult:
        """``speculative``: ``lookup`` proposes tokens from the text so far and checks them with the verify method
        (exactly the target's output: exporters.runtime.speculative), ``none`` decodes one token per call.
        ``draft_tokens``: proposals per verify call (1 to the program's get_draft_tokens); None adapts them.
        ``media``: the prompt with its images or recording (:meth:`with_images`, :meth:`with_audio`), fed as
        ExecuTorch's MultimodalRunner feeds it.
        With ``keep_cache``, the prompt's first tokens that the cache holds already are not run again.
        ``progress`` says what was done so far, also when ``on_text`` raised to stop it.
        ``on_logits``: told the logits each token is chosen from, in order (log-probabilities); it turns speculation
        off, whose verify calls choose several tokens from one call.
        ``constraint``: only the tokens its grammar allows are chosen (exporters.runtime.constraint); it turns
        speculation off too."""
        # A prompt with audio where text_decoder applies an adapter the text methods do not (Granite Speech's) goes on
        # through token_embedding and text_decoder, as the MultimodalRunner drives it, one token a call.
        heard_apart = media is not None and TEXT_DECODER_ADAPTER in self.program.method_names
        proposer = (self.speculation(speculative, draft_tokens)
                    if on_logits is None and constraint is None and not heard_apart else None)
        ids = media.ids if media is not None else prompt_ids if prompt_ids is not None else self.encode(prompt)
        self.check_fits(ids)
        stream = TextStream(self.tokenizer)
        self.progress = progress = Progress(self._reusable(ids) if media is None else 0)
        self._in_cache = []  # until the prompt is run, nothing is known to be there
        start = time.perf_counter()
        driver = self.driver
        if media is not None:
            roles = MethodRoles.through_embeddings(program_method_shapes(self.program))
            logits = prefill_parts(self.program, roles, media)
            driver = Driver(self.program, roles) if heard_apart else driver
        else:
            logits = self.driver.prefill(torch.tensor([ids[progress.cached:]], dtype=torch.int64),
                                         start=progress.cached)
        self._in_cache = ids if self.keep_cache and media is None else []
        prompt_s = time.perf_counter() - start
        start = time.perf_counter()

        def emit(token: int) -> None:
            progress.new_ids.append(token)
            piece = stream.push(token)
            if piece and on_text:
                on_text(piece)

        new_ids, stop, stats = continue_text(
            driver, ids, logits, cfg, Stops(self.eos_ids, self.max_context_len, self.endless),
            Speculation(proposer, draft_tokens) if proposer is not None else None, Observers(emit, on_logits),
            constraint)
        if self._in_cache:
            self._in_cache = ids + new_ids[:-1]  # the last token chosen may not have been run
        gen_s = time.perf_counter() - start
        return GenerationResult(
            text=stream.emitted, prompt_ids=ids, new_ids=new_ids, stop_reason=stop,
            prompt_tokens_per_s=len(ids) / prompt_s if prompt_s else float("inf"),
            generation_tokens_per_s=len(new_ids) / gen_s if gen_s and new_ids else 0.0, speculation=stats,
        )
