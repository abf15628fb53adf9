"""The audio encoder: an audio-language checkpoint's audio tower and projector beside its text decoder, in one program.

A checkpoint whose ``config.json`` names an audio-language architecture (``models.audio_language``: Voxtral,
Qwen2-Audio, Gemma 4, Granite Speech) gets a component ``audio`` with one method, ``audio_encoder`` (log-mel features
of W 30 s windows ``[W, bins, frames]`` to ``[1, W * N, hidden]`` embeddings; Gemma 4: one recording's
``[1, 128, 4m]`` frames to its ``m`` positions; Granite Speech: ``[1, T, 160]`` to ``3 * ceil(T / 15)``), and the
decoder gets ``token_embedding`` and ``text_decoder``: the methods ExecuTorch's
``MultimodalRunner`` calls for an audio prompt. ``preprocessor.pte`` beside the program turns raw 16 kHz samples into
the features (ExecuTorch's ``WhisperAudioProcessor``, its ``Gemma4SpeechTransformModel``, or Granite Speech's
log-mel in torch ops). The plan
reads ``config.json`` (not the weights) to size the method; load reads the tower and projector alone from the
decoder's checkpoint folder (``models.audio_encoder``); ``quant.audio`` quantizes it apart; validation runs the
validation recording and a prompt around it through the program (``exporters.validation.encoder_prompt``).

A checkpoint that carries the decoder's LoRA adapter for prompts with audio (Granite Speech's, which transformers
enables whenever a prompt has audio) gets it attached to the decoder, and ``text_decoder`` (the MultimodalRunner's
method for every token of such a prompt) computes with it; the text methods compute the base, over the same stored
weights (:data:`SPEECH_ADAPTER`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from tokenizers import Tokenizer
from transformers import AutoConfig

from exporters.components.kind import Basis, Bundled, Finalized, Kind, Part
from exporters.config import ExportConfig, ModelConfig, Source
from exporters.errors import UserError, check_choice
from exporters.manifest import AudioCheck, AudioEntry, ComponentEntry, Manifest
from exporters.output.files import private_path
from exporters.plan.component import Component, ComponentKind, FolderBuild, QuantPlan
from exporters.plan.footprint import Footprint, encoder_footprint
from exporters.program.audio import (AUDIO, AUDIO_METHOD, TEXT_DECODER_ADAPTER, audio_constants, audio_features,
                                     audio_spec, cropped, write_audio_preprocessor)
from exporters.program.methods import (MULTIMODAL_METHODS, MethodTable, check_encoder_unbuilt,
                                       check_runner_feeds)
from exporters.program.passes import noop_expands_dropped
from exporters.program.speech import PREPROCESSOR_FILE, SAMPLE_RATE, is_speech
from exporters.quant.audio import AUDIO_SCHEMES, AUTO, audio_scheme, quantize_audio
from exporters.runtime.audio import read_audio
from exporters.validation.encoder_prompt import (GREEDY_STEPS, EncoderBaseline, check_encoder_path, room_needed,
                                                unquantized_path)
from exporters.validation.speech import VALIDATION_RECORDING
from models.audio_encoder import audio_parameters, load_audio_encoder, random_audio_encoder
from models.audio_language import AudioGeometry, audio_language_of, is_audio_language
from models.lora import LoraAdapter, active_adapter, attach_adapters, read_adapter
from models.processor_files import saved_architectures
from models.tokenizer import find_tokenizer

if TYPE_CHECKING:
    from exporters.context import ExportContext
    from exporters.context.artifacts import WrittenProgram
    from exporters.program.lengths import Lengths
    from exporters.runtime.quality import TextWindows
    from exporters.validation.under_test import ProgramUnderTest
    from models.audio_encoder import AudioEncoder
    from models.checkpoint import Checkpoint

log = logging.getLogger("exporters")

# The name the checkpoint's adapter for prompts with audio gets on the decoder (its weights' names in the program, the
# program's TEXT_DECODER_ADAPTER constant).
SPEECH_ADAPTER = "speech"


@dataclass
class AudioRecord:
    """What the stages learn of the audio encoder."""

    checkpoint: Checkpoint  # the decoder's: the encoder is read from the same folder
    recording: str = ""  # the validation recording, and its length
    features: torch.Tensor | None = None  # its log-mel windows, as the preprocessor makes them
    quantization: str | None = None  # quantize: what quant.audio did
    baseline: EncoderBaseline | None = None  # baseline: the audio prompt through the unquantized models
    check: AudioCheck | None = None  # validate: the audio path in the program against eager
    adapter: LoraAdapter | None = None  # load: the decoder's adapter for prompts with audio, as the folder holds it


def audio_source(model: ModelConfig) -> tuple[AudioGeometry, str | None] | None:
    """The audio encoder ``model.checkpoint`` holds, from its ``config.json``, and the folder of the decoder's LoRA
    adapter for prompts with audio where the checkpoint carries one; None for any other checkpoint."""
    if model.source != Source.hf or model.checkpoint is None:
        return None
    path = Path(model.checkpoint).expanduser()
    if not is_audio_language(saved_architectures(path)):
        return None
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    family = audio_language_of(hf_config)
    if family is None:
        return None
    adapter = family.audio_adapter(hf_config, path) if family.audio_adapter is not None else None
    return family.geometry(hf_config), None if adapter is None else str(adapter)


def audio_per_call(geometry: AudioGeometry, call_tokens: int) -> int:
    """Windows one call of audio_encoder takes: the family's most, as many as one text_decoder call takes; for a
    recording of any length, the positions: the family's most (30 s), as many as one text_decoder call takes."""
    if geometry.any_length:  # whole windows of frames, where positions come per window (Granite Speech)
        return geometry.positions(geometry.frames_for(min(geometry.tokens, call_tokens)))
    return max(1, min(geometry.max_windows, call_tokens // geometry.tokens))


def shortest_call(geometry: AudioGeometry) -> int:
    """The fewest positions one text_decoder call must take for the MultimodalRunner to feed a recording: a whole
    window's, or one position of a recording of any length (the longest it takes then follows the call)."""
    return 1 if geometry.any_length else geometry.tokens


@dataclass(frozen=True)
class AudioBuild(FolderBuild):
    """How the audio encoder is built: from the decoder's checkpoint folder, by transformers' own modules."""

    geometry: AudioGeometry
    per_call: int  # windows a call of audio_encoder takes (a recording of any length: the most positions it gives)
    adapter: str | None = None  # the folder of the decoder's adapter for prompts with audio (audio_source)

    def build(self, checkpoint: Checkpoint, device: str = "cpu") -> AudioEncoder:
        """The encoder with the checkpoint's weights, or with seeded random ones of its shape (model.random_init)."""
        if self.model.random_init:
            encoder = random_audio_encoder(checkpoint.hf_config, self.model.seed)
        else:
            encoder = load_audio_encoder(str(checkpoint.path), checkpoint.hf_config)
        if self.geometry.frame_window:  # the frames a call takes, which its exported blocks cover (Granite Speech)
            encoder.max_frames = self.geometry.frames_for(self.per_call)
        return encoder


class Audio(Kind):
    name = str(ComponentKind.audio_encoder)

    def check(self, cfg: ExportConfig, lengths: Lengths) -> None:
        """What an audio-language export cannot do, refused before any weight is read."""
        check_choice("quant.audio", cfg.quant.audio, [AUTO, *AUDIO_SCHEMES], "Fix quant.audio.")
        source = audio_source(cfg.model)
        if source is None:
            if cfg.quant.audio != AUTO and not is_speech(cfg.model):
                raise UserError(f"quant.audio={cfg.quant.audio} quantizes an audio encoder (Whisper's, or an "
                                "audio-language model's), and model.checkpoint has none. Leave quant.audio unset.")
            return
        geometry, adapter = source
        what = f"{cfg.model.checkpoint} hears audio ({geometry.family}, {geometry.tokens} positions per 30 s)"
        check_runner_feeds(cfg, lengths, what, shortest_call(geometry), "a recording")
        if cfg.validate and room_needed(shortest_call(geometry)) > lengths.context:
            raise UserError(f"{what}, and the cache holds {lengths.context} positions (export.max_context_len): "
                            f"validation's prompt puts text and {GREEDY_STEPS} generated tokens around a recording. Set "
                            f"export.max_context_len={room_needed(shortest_call(geometry))} or more.")
        check_encoder_unbuilt(cfg, what, "audio", "an audio-language")
        if cfg.export.weights == "external" and adapter is not None:
            raise UserError(f"{what}, and its folder holds the decoder's LoRA adapter for prompts with audio "
                            "(adapter_config.json), which text_decoder applies; export.weights=external with that "
                            "adapter is not built yet (its weights would need a data file of their own). Export it "
                            "with the weights in the program (leave export.weights unset).")

    def plan(self, cfg: ExportConfig, basis: Basis) -> Component | None:
        """The audio encoder as a component of the plan (None for any other checkpoint)."""
        source = audio_source(cfg.model)
        if source is None:
            return None
        geometry, adapter = source
        per_call = audio_per_call(geometry, basis.lengths.call_tokens)
        table = MethodTable({AUDIO_METHOD: audio_spec(geometry, per_call)}, {AUDIO_METHOD: None}, {},
                            {AUDIO_METHOD: AUDIO})
        build = AudioBuild(cfg.model, geometry, per_call, adapter)
        return Component(name=AUDIO, kind=ComponentKind.audio_encoder, build=build,
                         quant=QuantPlan(cfg.quant, cfg.export.tied_embedding, basis.shortcuts), methods=table)

    def decoder_methods(self, component: Component) -> Sequence[str]:
        return MULTIMODAL_METHODS

    def decoder_adapters(self, component: Component) -> dict[str, str]:
        """text_decoder computes with the checkpoint's adapter for prompts with audio, where it carries one."""
        return {"text_decoder": SPEECH_ADAPTER} if component.build.adapter is not None else {}

    def open(self, part: Part, ctx: ExportContext) -> Footprint:
        """The audio encoder, alive beside the decoder from load to the end; read from the decoder's checkpoint."""
        checkpoint = ctx.main.checkpoint
        ctx.records[part.name] = AudioRecord(checkpoint)
        # With an encoder's measured factor: Voxtral Mini's own is not measured yet (docs/speech.md).
        return encoder_footprint(audio_parameters(checkpoint.hf_config))

    def load(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        """The encoder; and the decoder's adapter for prompts with audio, read and attached to the (unquantized)
        decoder, which computes the base until a method applies it."""
        build, record = part.component.build, ctx.record(part.name)
        models[part.name] = build.build(record.checkpoint)
        if build.adapter is not None:
            decoder = models[ctx.plan.main.name]
            family = audio_language_of(record.checkpoint.hf_config)
            assert family is not None, "planned from this checkpoint's config"
            record.adapter = read_adapter(SPEECH_ADAPTER, build.adapter, decoder, family.adapter_prefixes)
            attach_adapters(decoder, [record.adapter])

    def heard_through(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> Any:
        """The eager decoder as text_decoder computes it: with the adapter for prompts with audio, where there is one."""
        adapter = ctx.record(part.name).adapter
        return active_adapter(models[ctx.plan.main.name], adapter.name if adapter is not None else None)

    def baseline(self, part: Part, ctx: ExportContext, models: dict[str, Any], windows: TextWindows | None) -> None:
        """The validation recording's features, and the audio prompt through the unquantized encoder and decoder."""
        record, build = ctx.record(part.name), part.component.build
        given = ctx.config.validation.audio_file
        recording = read_audio(Path(given).expanduser() if given else VALIDATION_RECORDING)
        features = audio_features(torch.from_numpy(recording.samples), build.geometry)
        model = models[ctx.plan.main.name]
        g = build.geometry
        if g.any_length:  # as many positions as one call and the cache hold beside the prompt's text
            record.features = cropped(features, g, min(build.per_call, model.args.max_context_len - room_needed(0)))
            seconds = record.features.shape[1 if g.time_major else -1] / g.frames_per_second
        else:
            record.features = features[:build.per_call]
            seconds = 30.0 * record.features.shape[0]
        record.recording = f"{Path(recording.source).name} ({min(recording.seconds, seconds):.1f} s)"
        assert windows is not None, "an audio-language program's main model is a language model"
        with self.heard_through(part, ctx, models):
            record.baseline = unquantized_path(model, models[part.name], record.features, windows.windows[0])

    def quantize(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        """After the decoder: the encoder's output must be in the dtype the decoder now computes in."""
        encoder, quant = models[part.name], part.component.quant.config
        encoder.out_dtype = models[ctx.plan.main.name].activation_dtype()
        ctx.record(part.name).quantization = quantize_audio(encoder, audio_scheme(quant), quant.group_size)

    def passes(self, part: Part) -> list[Any]:
        return [noop_expands_dropped()]

    def constants(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> dict[str, Any]:
        """What an app needs to make audio_encoder's input and to place its embeddings in a prompt."""
        build = part.component.build
        adapter = {TEXT_DECODER_ADAPTER: SPEECH_ADAPTER} if build.adapter is not None else {}
        return {**audio_constants(build.geometry, build.per_call), **adapter}

    def validate(self, part: Part, ctx: ExportContext, under: ProgramUnderTest, models: dict[str, Any]) -> None:
        record = ctx.record(part.name)
        assert record.features is not None, "the baseline stage read the validation recording"
        with self.heard_through(part, ctx, models):
            record.check = AudioCheck(recording=record.recording, **check_encoder_path(
                under.program, AUDIO_METHOD, record.features, models[ctx.plan.main.name], models[part.name],
                under.text.windows[0], under.tolerance.max_kl, record.baseline))
        log.info("  validate: audio path %s", "passed" if record.check.passed else "FAILED")

    def failures(self, part: Part, ctx: ExportContext) -> list[str]:
        check = ctx.record(part.name).check
        return [f"the audio path: {', '.join(check.failures)}"] if check is not None and not check.passed else []

    def finalize(self, part: Part, ctx: ExportContext, written: WrittenProgram, pte: Path) -> Finalized:
        """The manifest's record of the encoder, and the preprocessor beside the program."""
        encoder = written.components[part.name]
        geometry = part.component.build.geometry
        final = pte.parent / PREPROCESSOR_FILE
        staged = private_path(final, "staged")
        what = write_audio_preprocessor(staged, geometry)
        log.info("  finalize: wrote %s (%s)", PREPROCESSOR_FILE, what)
        entry = ComponentEntry(
            kind=str(part.component.kind), methods=list(written.methods.of_component(part.name)), adapters=[],
            checkpoint=str(ctx.record(part.name).checkpoint.path), parameters=sum(p.numel() for p in encoder.parameters()),
            state=[], family=geometry.family, audio=self.entry(part, ctx))
        return Finalized(entry, staged={final: staged})

    def entry(self, part: Part, ctx: ExportContext) -> AudioEntry:
        """The manifest's record of the encoder: what an app does to a recording, and how the audio path was checked."""
        build, record = part.component.build, ctx.record(part.name)
        g = build.geometry
        tokenizer = find_tokenizer(ctx.main.checkpoint.path)
        vocabulary = (Tokenizer.from_file(str(tokenizer)) if tokenizer is not None and tokenizer.name == "tokenizer.json"
                      else None)

        def text(token_id: int | None) -> str | None:
            return vocabulary.id_to_token(token_id) if vocabulary is not None and token_id is not None else None

        adapter = record.adapter
        common = dict(family=g.family, sample_rate=SAMPLE_RATE, mel_bins=g.bins, audio_token_id=g.audio_token_id,
                      audio_token=text(g.audio_token_id), preprocessor=PREPROCESSOR_FILE,
                      quantization=record.quantization or "fp32", check=record.check,
                      adapter=None if adapter is None else adapter.describe())
        if not g.any_length:
            return AudioEntry(**common, frames=g.frames, tokens_per_window=g.tokens, max_windows=build.per_call,
                              input=f"float32 [windows, {g.bins}, {g.frames}]: log-mel features of 1 to "
                                    f"{build.per_call} 30 s windows (preprocessor.pte makes them of 16 kHz mono samples)")
        frames = g.frames_for(build.per_call)
        seconds = f"{frames / g.frames_per_second:.1f} s at most"
        if g.frame_window:
            return AudioEntry(**common, frames=frames, tokens_per_window=build.per_call, max_windows=1,
                              frames_per_token=g.frames_per_token, frame_window=g.frame_window,
                              frames_per_second=g.frames_per_second,
                              input=f"float32 [1, T, {g.bins}], T from 1 to {frames}: one recording's frames "
                                    f"({seconds}; two log-mel frames side by side each, preprocessor.pte makes them of "
                                    f"16 kHz mono samples), {g.frame_window} frames to "
                                    f"{g.frame_window // g.frames_per_token} positions, the last window partial")
        return AudioEntry(**common, frames=frames, tokens_per_window=build.per_call, max_windows=1,
                          frames_per_token=g.frames_per_token, begin_token_id=g.begin_token_id,
                          begin_token=text(g.begin_token_id), end_token_id=g.end_token_id,
                          end_token=text(g.end_token_id),
                          input=f"float32 [1, {g.bins}, {g.frames_per_token}m], m from 1 to {build.per_call}: one "
                                f"recording's log-mel frames ({seconds}), zeros after its last to "
                                f"a multiple of {g.frames_per_token} (preprocessor.pte makes them of 16 kHz mono "
                                "samples)")

    def describe(self, stage: str, part: Part, ctx: ExportContext, models: dict[str, Any]) -> str:
        if stage == "load":
            adapter = ctx.record(part.name).adapter
            heard = "" if adapter is None else f"; text_decoder applies the adapter for audio prompts {adapter.describe()}"
            return f"; {part.name}: {models[part.name].describe()}{heard}"
        if stage == "quantize":
            return f"; audio encoder: {ctx.record(part.name).quantization}"
        return ""

    def bundle(self, m: Manifest) -> Bundled:
        """The bundle carries the preprocessor and says how an app feeds audio."""
        entry = self.entry_of(m)
        if entry is None or entry.audio is None:
            return Bundled()
        return Bundled(readme=bundle_readme(entry.audio), files=[PREPROCESSOR_FILE],
                       fields={"audio": dataclasses.asdict(entry.audio)})


def bundle_readme(a: AudioEntry) -> str:
    """The bundle README's section on audio: what an app does to a recording, and which runner takes it."""
    if a.frame_window:
        what = f"""`{PREPROCESSOR_FILE}` turns a recording into `audio_encoder`'s input: its `forward` takes 16 kHz mono float32
samples `[N]` (up to 30 s) and gives frames `[1, T, {a.mel_bins}]`, {a.frames_per_second} a second (two log-mel frames side by
side each). `audio_encoder` takes one recording of up to {a.frames} frames ({a.frames / a.frames_per_second:.1f} s) in one call
and returns {a.frame_window // a.frames_per_token} embeddings for every {a.frame_window} frames (the last ones partial: `3 *
ceil(T / {a.frame_window})` in all), which `text_decoder` takes at the next positions; text goes through
`token_embedding` then `text_decoder`. In a prompt the audio's place is token {a.audio_token_id} (`{a.audio_token}`),
once per embedding."""
        shape = f"`batch` = 1, `n_frames` = T, `n_bins` = {a.mel_bins} (time-major)"
    elif a.frames_per_token:
        what = f"""`{PREPROCESSOR_FILE}` turns a recording into `audio_encoder`'s input: its `forward` takes 16 kHz mono float32
samples `[N]` (up to 30 s) and gives log-mel frames `[1, {a.mel_bins}, {a.frames_per_token}m]`, 100 a second, zeros
after the last to a multiple of {a.frames_per_token}. `audio_encoder` takes one recording of up to {a.tokens_per_window}
positions ({a.frames / a.frames_per_second:.1f} s) in one call and returns its `m` embeddings, which `text_decoder` takes at the next
positions; text goes through `token_embedding` then `text_decoder`. In a prompt the audio's place is token
{a.begin_token_id} (`{a.begin_token}`), token {a.audio_token_id} (`{a.audio_token}`) `m` times, then token
{a.end_token_id} (`{a.end_token}`): the text before the audio ends with the first, the text after it starts with the
last."""
        shape = f"`batch` = 1, `n_bins` = {a.mel_bins}, `n_frames` = {a.frames_per_token}m"
    else:
        what = f"""`{PREPROCESSOR_FILE}` turns a recording into `audio_encoder`'s input: its `forward` takes 16 kHz mono float32
samples `[N]` and gives log-mel features `[windows, {a.mel_bins}, {a.frames}]`, one row per 30 s window.
`audio_encoder` takes 1 to {a.max_windows} window(s) in one call and returns {a.tokens_per_window} embeddings per
window, which `text_decoder` takes at the next positions; text goes through `token_embedding` then `text_decoder`. In a
prompt the audio's place is token {a.audio_token_id} (`{a.audio_token}`), {a.tokens_per_window} times per window."""
        shape = f"`batch` = windows, `n_bins` = {a.mel_bins}, `n_frames` = {a.frames}"
    if a.adapter:
        what += f"""

`text_decoder` computes with the checkpoint's LoRA adapter for prompts with audio ({a.adapter}), as transformers
enables it whenever a prompt has audio; the text methods compute the base model (the same stored weights). Continue an
audio prompt through `token_embedding` and `text_decoder`, as the `MultimodalRunner` does, not through the text methods."""
    return f"""## Audio

{what}

- Android / iOS (C++): run `{PREPROCESSOR_FILE}` on the samples, then `MultimodalRunner` from
  `executorch/extension/llm/runner` with a list of inputs: the text before the audio, `Audio` (the features above,
  float32, {shape}), the text after; it calls the three methods in order and then decodes.
- Python: `executorch.extension.llm.runner.MultimodalRunner("<program>", "tokenizer.json")` with
  `[make_token_input(before), make_audio_input(features), make_token_input(after)]`.
- `python -m exporters.generate <this folder> prompt="..." audio=<file>` (the audio goes before the prompt's text).

"""
