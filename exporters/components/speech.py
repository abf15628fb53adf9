"""A speech recognizer as the program's main model: Whisper's encoder and text decoder, for ExecuTorch's ``AsrRunner``.

A checkpoint whose ``config.json`` names ``WhisperForConditionalGeneration`` (or a faster-whisper folder, read by
``models.ctranslate2``) is claimed by this kind instead of the decoder: the program holds ``encoder`` (log-mel
features to encoder states) and ``text_decoder`` (tokens, the encoder states as the runner passes them, and
``cache_position`` to logits), sharing the self-attention cache and the cross-attention keys and values the encoder
keeps (``models.whisper``), beside the constants a runner needs (``exporters.program.speech``) and a
``preprocessor.pte`` (raw 16 kHz samples to features). ``quant.linear`` quantizes the decoder's linear layers,
``quant.audio`` the encoder's; validation transcribes a recording with the program and the eager model
(``exporters.validation.speech``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from exporters.components.kind import Basis, Bundled, Finalized, Kind, Part
from exporters.config import DType, ExportConfig, KvDType, WeightsPlacement
from exporters.errors import UserError
from exporters.manifest import (AppliedQuantization, ComponentEntry, LayoutEntry, Manifest, MethodEntry, ModelEntry,
                                SpeechEntry)
from exporters.output.files import private_path
from exporters.plan.component import Component, ComponentKind, FolderBuild, QuantPlan
from exporters.plan.footprint import BASE_BYTES, Footprint
from exporters.program.constants import recorded
from exporters.program.methods import MethodTable
from exporters.program.passes import noop_expands_dropped
from exporters.program.signatures import signature
from exporters.program.speech import (CHUNK_SECONDS, METHODS, PREPROCESSOR_FILE, SAMPLE_RATE, SpeechTokens,
                                      is_speech, speech_constants, write_preprocessor)
from exporters.quant.apply import quantize_linear_role
from exporters.quant.audio import audio_scheme, quantize_audio
from exporters.quant.schemes import DTYPES
from exporters.validation.speech import SpeechBaseline, check_speech, transcribe_eager, validation_input
from models.whisper import ENCODER, TEXT_DECODER, EncoderMethod, TextDecoderMethod, WhisperProgram, example_inputs

if TYPE_CHECKING:
    from exporters.context import ExportContext
    from exporters.context.artifacts import WrittenProgram
    from exporters.manifest import SpeechCheck
    from exporters.program.lengths import Lengths
    from exporters.runtime.quality import TextWindows
    from exporters.validation.under_test import ProgramUnderTest
    from models.checkpoint import Checkpoint

log = logging.getLogger("exporters")

SPEECH = "speech"  # the component's name
# Peak RSS per byte of the fp32 weights, over the base: measured on Whisper base (docs/speech.md).
PEAK_PER_BYTE = 6.0


@dataclass(frozen=True)
class SpeechBuild(FolderBuild):
    """How the speech model is built: transformers' Whisper with the checkpoint's weights (or seeded random ones of
    its shape), wrapped with the program's state for ``max_tokens`` decoder positions."""

    max_tokens: int | None  # export.max_context_len; None: the checkpoint's decoder positions

    def build(self, checkpoint: Checkpoint, device: str = "cpu") -> WhisperProgram:
        """transformers' eager attention in the encoder: its SDPA lowers to portable checks for fully masked rows on
        every [heads, 1500, 1500] score matrix (half the encoder's time on Whisper base: docs/DESIGN.md)."""
        from transformers import AutoModelForSpeechSeq2Seq

        if device == "meta" or self.model.random_init:
            torch.manual_seed(self.model.seed)
            with torch.device(device):
                hf = AutoModelForSpeechSeq2Seq.from_config(checkpoint.hf_config, attn_implementation="eager")
        else:
            hf = AutoModelForSpeechSeq2Seq.from_pretrained(str(checkpoint.path), dtype=torch.float32,
                                                           attn_implementation="eager")
        return WhisperProgram(hf.float().eval(), self.max_tokens)


@dataclass
class SpeechRecord:
    """What the stages learn of the speech model (its checkpoint and quantization are the manifest's top level)."""

    checkpoint: Checkpoint
    parameters: int
    tokens: SpeechTokens
    quantization: AppliedQuantization | None = None
    audio_quantization: str | None = None  # quant.audio, as applied to the encoder
    validation: None = None  # the top-level report is a language model's; the speech check is the component's
    baseline: SpeechBaseline | None = None
    check: SpeechCheck | None = None


def _linears(module: nn.Module, prefix: str) -> dict[str, nn.Linear]:
    return {f"{prefix}.{n}": m for n, m in module.named_modules() if isinstance(m, nn.Linear)}


class Speech(Kind):
    name = str(ComponentKind.asr)
    main = True

    def check(self, cfg: ExportConfig, lengths: Lengths) -> None:
        """What a speech export cannot do, refused before any weight is read."""
        if not is_speech(cfg.model):
            return  # quant.audio without an audio encoder: refused by exporters.components.audio
        q, ex = cfg.quant, cfg.export
        what = f"{cfg.model.checkpoint} is a speech recognizer (Whisper)"
        if cfg.backend.name not in ("xnnpack", "portable"):
            raise UserError(f"{what}, and backend={cfg.backend.name}: speech programs are built for backend=xnnpack "
                            "and backend=portable so far. Use one of them.")
        unbuilt = (("quant.pt2e", q.pt2e), ("quant.embedding", q.embedding), ("quant.adapters", q.adapters),
                   ("quant.size_budget", q.size_budget), ("draft.checkpoint", cfg.draft.checkpoint),
                   ("model.adapters", cfg.model.adapters or None),
                   ("quant.rotation", None if str(q.rotation) == "none" else q.rotation),
                   ("quant.online_hadamard", q.online_hadamard or None),
                   ("quant.algorithm", None if str(q.algorithm) in ("hqq", "affine") else q.algorithm),
                   ("quant.dtype", None if q.dtype == DType.fp32 else q.dtype),
                   ("export.kv_dtype", None if ex.kv_dtype == KvDType.fp32 else ex.kv_dtype),
                   ("export.attention_sink", ex.attention_sink or None),
                   ("export.weights", None if ex.weights == WeightsPlacement.program else ex.weights))
        for key, value in unbuilt:
            if value is not None:
                raise UserError(f"{what}, and {key}={value}: not built for speech programs yet. Export it without "
                                f"{key}.")

    def plan(self, cfg: ExportConfig, basis: Basis) -> Component | None:
        """The speech model as the program's main component (None: not a speech checkpoint)."""
        if not is_speech(cfg.model):
            return None
        build = SpeechBuild(cfg.model, cfg.export.max_context_len)
        return Component(name=SPEECH, kind=ComponentKind.asr, build=build,
                         quant=QuantPlan(cfg.quant, cfg.export.tied_embedding, basis.shortcuts),
                         methods=MethodTable({}, {}, {}))

    def open(self, part: Part, ctx: ExportContext) -> Footprint:
        build = part.component.build
        checkpoint = build.checkpoint(ctx.output_dir)
        shapes = build.build(checkpoint, device="meta")
        parameters = sum(p.numel() for p in shapes.parameters())
        ctx.records[part.name] = SpeechRecord(checkpoint, parameters, SpeechTokens.of(generation_config(checkpoint)))
        fp32 = 4 * parameters
        return Footprint(parameters, fp32, fp32, fp32,
                         {stage: BASE_BYTES + int(PEAK_PER_BYTE * fp32)
                          for stage in ("load", "quantize", "lower", "emit", "validate")})

    def load(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        models[part.name] = part.component.build.build(ctx.record(part.name).checkpoint)

    def baseline(self, part: Part, ctx: ExportContext, models: dict[str, Any], windows: TextWindows | None) -> None:
        """The unquantized model's transcript of the validation recording."""
        record, model = ctx.record(part.name), models[part.name]
        given = validation_input(_audio_file(ctx), feature_extractor(record.checkpoint), record.tokens)
        record.baseline = SpeechBaseline(given, transcribe_eager(model, given, record.tokens))

    def quantize(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        """quant.audio on the encoder's linear layers, quant.linear on the decoder's (the cross-attention's keys and
        values, computed by the encoder method, included)."""
        model, quant, record = models[part.name], part.component.quant.config, ctx.record(part.name)
        record.audio_quantization = quantize_audio(model.audio, audio_scheme(quant), quant.group_size)
        applied = AppliedQuantization(dtype=str(quant.dtype), notes=[f"encoder (quant.audio): {record.audio_quantization}"])
        dtype = DTYPES[str(quant.dtype)]
        if quant.linear is not None:
            layers = _linears(model.text.layers, "decoder.layers")
            applied.linear = quantize_linear_role("linear", layers, quant.linear, quant.group_size, str(quant.algorithm),
                                                  dtype, applied.notes)
        applied.tied_embedding = self._head(model, part.component.quant, applied, dtype)
        record.quantization = applied

    @staticmethod
    def _head(model: WhisperProgram, plan: QuantPlan, applied: AppliedQuantization, dtype: torch.dtype) -> str:
        """The output projection, tied to the token embedding: quantized apart (quant.lm_head: its own copy, the
        embedding kept in float), or computed from the embedding's own matrix (``shared``: stored once) or from a
        copy (``copied``: XNNPACK packs it once at load)."""
        quant = plan.config
        if quant.lm_head is not None:
            model.proj_out.weight = nn.Parameter(model.proj_out.weight.detach().clone(), requires_grad=False)
            applied.lm_head = quantize_linear_role("lm_head", {"proj_out": model.proj_out}, quant.lm_head,
                                                   quant.lm_head_group_size, str(quant.algorithm), dtype, applied.notes)
            model.tied_head = False
            return "untied"
        if str(plan.tied_storage) == "copied":
            model.proj_out.weight = nn.Parameter(model.proj_out.weight.detach().clone(), requires_grad=False)
            model.tied_head = False
            return "copied"
        return "shared"

    def capture(self, part: Part, models: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """``encoder`` (fixed: one 30 s window) and ``text_decoder`` (1 to the cache's tokens per call)."""
        model: WhisperProgram = models[part.name]
        tokens = torch.export.Dim("num_tokens", min=1, max=model.max_tokens)
        with torch.no_grad():
            encoder = torch.export.export(EncoderMethod(model), example_inputs(model.shape, ENCODER), strict=False)
            decoder = torch.export.export(TextDecoderMethod(model), example_inputs(model.shape, TEXT_DECODER, 2),
                                          dynamic_shapes=({1: tokens}, None, {0: tokens}), strict=False)
        return {ENCODER: (encoder, signature(encoder)), TEXT_DECODER: (decoder, signature(decoder))}

    def passes(self, part: Part) -> list[Any]:
        return [noop_expands_dropped()]

    def constants(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> dict[str, Any]:
        model = models[part.name]
        return speech_constants(model.shape, ctx.record(part.name).tokens, model.max_tokens)

    def validate(self, part: Part, ctx: ExportContext, under: ProgramUnderTest, models: dict[str, Any]) -> None:
        record = ctx.record(part.name)
        assert record.baseline is not None
        record.check = check_speech(under.program, models[part.name], record.baseline, record.tokens,
                                    under.tolerance, text_decoder_of(record.checkpoint))
        log.info("  validate: speech %s", record.check.describe())

    def failures(self, part: Part, ctx: ExportContext) -> list[str]:
        check = ctx.record(part.name).check
        return [f"the transcript: {', '.join(check.failures)}"] if check is not None and not check.passed else []

    def finalize(self, part: Part, ctx: ExportContext, written: WrittenProgram, pte: Path) -> Finalized:
        """The manifest's entries of the program (methods, layout, constants, model), and the preprocessor beside it."""
        record, model = ctx.record(part.name), written.model
        final = pte.parent / PREPROCESSOR_FILE
        staged = private_path(final, "staged")
        log.info("  finalize: writing %s (ExecuTorch's WhisperAudioProcessor, raw 16 kHz samples to features)",
                 PREPROCESSOR_FILE)
        write_preprocessor(staged, model.shape.mel_bins)
        entry = ComponentEntry(kind=str(part.component.kind), methods=list(METHODS), adapters=[],
                               checkpoint=str(record.checkpoint.path), parameters=record.parameters,
                               state=["kv_cache", "cross_attention"], family="whisper",
                               speech=self.entry(part, ctx, model))
        return Finalized(entry, fields=program_fields(ctx, written, record), staged={final: staged})

    def entry(self, part: Part, ctx: ExportContext, model: WhisperProgram) -> SpeechEntry:
        record, s = ctx.record(part.name), model.shape
        t = record.tokens
        return SpeechEntry(
            family="whisper", sample_rate=SAMPLE_RATE, mel_bins=s.mel_bins, chunk_seconds=CHUNK_SECONDS,
            frames=s.frames, max_tokens=model.max_tokens,
            tokens={"start": t.start, "end": t.end, "transcribe": t.transcribe, "translate": t.translate,
                    "no_timestamps": t.no_timestamps, "languages": t.languages, "suppress": list(t.suppress),
                    "suppress_at_begin": list(t.suppress_at_begin)},
            preprocessor=PREPROCESSOR_FILE,
            quantization={"encoder": record.audio_quantization or "fp32",
                          "decoder": record.quantization.linear.scheme if record.quantization and
                          record.quantization.linear else "fp32"},
            check=record.check)

    def describe(self, stage: str, part: Part, ctx: ExportContext, models: dict[str, Any]) -> str:
        record = ctx.record(part.name)
        if stage == "load":
            s = models[part.name].shape
            return (f"whisper, {record.parameters / 1e6:.2f}M parameters, {s.layers} decoder layers, {s.mel_bins} mel "
                    f"bins, vocab {s.vocab}")
        if stage == "baseline" and record.baseline is not None:
            text = text_decoder_of(record.checkpoint)(record.baseline.tokens)
            return f"unquantized transcript of {record.baseline.input.recording}: {text.strip()!r}"
        if stage == "quantize":
            q = record.quantization
            return (f"encoder {record.audio_quantization}; decoder "
                    + (f"{q.linear.scheme} on {len(q.linear.layers)} linear layers" if q and q.linear else "fp32"))
        if stage == "validate" and record.check is not None:
            return record.check.describe()
        return ""

    def bundle(self, m: Manifest) -> Bundled:
        entry = self.entry_of(m)
        if entry is None or entry.speech is None:
            return Bundled()
        check = entry.speech.check
        return Bundled(readme=bundle_readme(entry.speech), files=[PREPROCESSOR_FILE],
                       fields={"speech": dataclasses.asdict(entry.speech)}, run=run_text(m),
                       validation="Not validated (exported with validate=false)." if check is None else
                       f"A recording ({check.recording}) transcribed in the ExecuTorch runtime and by the eager "
                       f"model: {check.describe()}. The program's transcript: {check.transcript.strip()!r}.")


def _audio_file(ctx: ExportContext) -> Path | None:
    given = ctx.config.validation.audio_file
    return Path(given).expanduser() if given else None


def generation_config(checkpoint: Checkpoint) -> Any:
    from transformers import GenerationConfig

    if checkpoint.generation_config_file is None:
        raise UserError(f"{checkpoint.path}: generation_config.json is missing: a Whisper checkpoint's names the "
                        "start, language and task tokens and the suppressed ones. Copy it from the model's folder.")
    return GenerationConfig.from_pretrained(str(checkpoint.path))


def feature_extractor(checkpoint: Checkpoint) -> Any:
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=checkpoint.hf_config.num_mel_bins)


def text_decoder_of(checkpoint: Checkpoint) -> Any:
    """Token ids -> text, special tokens left out (the checkpoint's tokenizer.json)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint.path / "tokenizer.json"))
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def program_fields(ctx: ExportContext, written: WrittenProgram, record: SpeechRecord) -> dict[str, Any]:
    """The manifest's sections on the program as ExecuTorch's AsrRunner drives it."""
    ckpt = record.checkpoint
    model: WhisperProgram = written.model  # type: ignore[assignment]
    signatures = written.methods.signatures
    return dict(
        methods={name: MethodEntry(inputs=signatures[name].inputs, outputs=signatures[name].outputs,
                                   dynamic_tokens=name == TEXT_DECODER,
                                   tokens=[1, model.max_tokens] if name == TEXT_DECODER else [0, 0],
                                   delegated_partitions=written.delegated_partitions.get(name, 0))
                 for name in METHODS},
        layout=LayoutEntry(
            name="asr", audience="ExecuTorch's AsrRunner (extension/asr/runner) and exporters.generate audio=",
            methods={ENCODER: "encoder", TEXT_DECODER: "text_decoder"}, prompt_method=TEXT_DECODER,
            token_method=TEXT_DECODER,
            call_order=(f"{PREPROCESSOR_FILE} (samples -> features, per 30 s window), encoder once per window, then "
                        "text_decoder(token, encoder states, cache_position) from decoder_start_token_id until an id "
                        "of get_eos_ids"),
            kv_cache=(f"self-attention: {model.max_tokens} positions per window, written from cache_position 0 by "
                      "each new window; cross-attention: the encoder's keys and values of the current window"),
            stock_runners={}),
        constant_methods=recorded(written.constant_methods),
        model=ModelEntry(checkpoint=str(ckpt.path), architecture=list(ckpt.hf_config.architectures or []),
                         family="whisper", attention="sdpa", parameters=record.parameters,
                         converted_from=ckpt.converted_from),
    )


def run_text(m: Manifest) -> str:
    """The bundle README's "Run it": the calls an app makes, in order."""
    return (f"Layout `{m.layout.name}`: {m.layout.call_order}. The methods share the decoder's self-attention cache "
            "and the cross-attention state `encoder` writes: load them from one `Program` (Python: "
            "`executorch.runtime.Runtime.get().load_program(\"model.pte\")`; C++: one `Module`), as ExecuTorch's "
            "`AsrRunner` does. Section \"Speech\" below gives each call's inputs.")


def bundle_readme(s: SpeechEntry) -> str:
    """The bundle README's section on audio: what an app does to a recording, and which runner takes it."""
    return f"""## Speech

The program transcribes {s.sample_rate} Hz mono audio in windows of {s.chunk_seconds} s. `{PREPROCESSOR_FILE}` turns
float samples `[N]` into log-mel features `[windows, {s.mel_bins}, {s.frames}]`; `encoder` takes one window
`[1, {s.mel_bins}, {s.frames}]`; `text_decoder(token [1, 1] int64, encoder states, cache_position [1] int64)` then
runs once per token from token {s.tokens['start']} until token {s.tokens['end']} (at most {s.max_tokens} positions
per window, the prompt's included).

- Android / iOS (C++): ExecuTorch's `AsrRunner` (`extension/asr/runner`) with this program and `tokenizer.json`, the
  preprocessor run first as in `examples/models/whisper/main.cpp`.
- `python -m exporters.generate <this folder> audio=<file.wav>` (any sample rate or channel count; converted).

"""

