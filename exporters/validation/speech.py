"""A speech program against its eager model on a validation recording.

Three checks, each of what the program computes against what the eager (quantized) model computes on the same
input: the encoder's states (least cosine of a position), the decoder's logits along the eager model's transcript
(KL and top-1, teacher-forced, so one early difference does not hide the rest), and the greedy transcripts
(token-identical, and the word error rate). The unquantized model's transcript, made before quantization, gives
what quantization cost (reported, not judged). The recording is ``validation.audio_file`` or the one shipped
(``exporters/data/validation_speech.wav``: a sentence spoken by espeak-ng, used by nothing else).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from exporters.manifest import SpeechCheck
from exporters.plan.validation import Tolerance
from exporters.program.speech import SpeechTokens
from exporters.runtime.audio import RunDecoder, RunEncoder, features, greedy, read_audio, windows
from models.whisper import ENCODER, TEXT_DECODER, WhisperProgram

log = logging.getLogger("exporters")

VALIDATION_RECORDING = Path(__file__).resolve().parents[1] / "data" / "validation_speech.wav"
#: The least cosine of one encoder position's state, program against eager (fp32 programs give > 0.9999).
MIN_ENCODER_COSINE = 0.99


@dataclass(frozen=True)
class SpeechInput:
    """The validation recording's first window as the encoder takes it, and the transcript's prompt."""

    recording: str
    features: torch.Tensor
    prompt: list[int]


@dataclass(frozen=True)
class SpeechBaseline:
    """The unquantized model's transcript of the validation recording."""

    input: SpeechInput
    tokens: list[int]


def validation_input(path: Path | None, extractor: Any, tokens: SpeechTokens) -> SpeechInput:
    recording = read_audio(path or VALIDATION_RECORDING)
    english = tokens.languages.get("en")
    return SpeechInput(f"{Path(recording.source).name} ({recording.seconds:.1f} s)",
                       features(windows(recording)[0], extractor), tokens.prompt(english, "transcribe"))


def eager_runners(model: WhisperProgram) -> tuple[RunEncoder, RunDecoder]:
    def encode(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model.encode(x)

    def decode(ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model.decode(ids, states, positions)

    return encode, decode


def program_runners(program: Any) -> tuple[RunEncoder, RunDecoder]:
    """The program's two methods (a LoadedProgram, or CapturedPrograms standing in for it)."""
    return (lambda x: program.run(ENCODER, x)[0],
            lambda ids, states, positions: program.run(TEXT_DECODER, ids, states, positions)[0])


def transcribe_eager(model: WhisperProgram, given: SpeechInput, tokens: SpeechTokens) -> list[int]:
    encode, decode = eager_runners(model)
    return greedy(decode, encode(given.features), given.prompt, tokens, model.max_tokens - len(given.prompt))


def word_error_rate(reference: str, hypothesis: str) -> float:
    """jiwer's WER on lower-cased words without punctuation; 0 when both are empty."""
    import jiwer

    normalize = jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation(), jiwer.RemoveMultipleSpaces(),
                               jiwer.Strip(), jiwer.ReduceToListOfListOfWords()])
    if not reference.strip():
        return 0.0 if not hypothesis.strip() else 1.0
    return float(jiwer.wer(reference, hypothesis, reference_transform=normalize, hypothesis_transform=normalize))


def _least_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.float().flatten(0, -2), b.float().flatten(0, -2), dim=-1).min())


def check_speech(program: Any, model: WhisperProgram, baseline: SpeechBaseline, tokens: SpeechTokens,
                 tolerance: Tolerance, decode_text: Any) -> SpeechCheck:
    """The program's encoder, decoder and transcript against ``model`` (the eager, quantized model)."""
    given = baseline.input
    started = time.perf_counter()
    run_encoder, run_decoder = program_runners(program)
    eager_encoder, eager_decoder = eager_runners(model)
    states, eager_states = run_encoder(given.features), eager_encoder(given.features)
    cosine = _least_cosine(states, eager_states)
    budget = model.max_tokens - len(given.prompt)
    eager_tokens = greedy(eager_decoder, eager_states, given.prompt, tokens, budget)
    forced = torch.tensor([given.prompt + eager_tokens[:budget - 1]])
    positions = torch.arange(forced.shape[1])
    logits = run_decoder(forced, states, positions)[0].float()
    eager_logits = eager_decoder(forced, eager_states, positions)[0].float()
    kl = F.kl_div(logits.log_softmax(-1), eager_logits.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    scored = slice(len(given.prompt) - 1, None)  # the positions that predict transcript tokens
    top1 = float((logits[scored].argmax(-1) == eager_logits[scored].argmax(-1)).float().mean())
    program_tokens = greedy(run_decoder, states, given.prompt, tokens, budget)
    text, eager_text, unquantized_text = (decode_text(t) for t in (program_tokens, eager_tokens, baseline.tokens))
    failures = []
    if cosine < MIN_ENCODER_COSINE:
        failures.append(f"encoder states cosine {cosine:.4f} < {MIN_ENCODER_COSINE}")
    if float(kl[scored].max()) > tolerance.max_kl:
        failures.append(f"decoder KL max {float(kl[scored].max()):.3g} > {tolerance.max_kl}")
    if top1 < tolerance.min_top1:
        failures.append(f"decoder top-1 {top1:.3f} < {tolerance.min_top1}")
    log.info("  validate: speech checked in %.1f s", time.perf_counter() - started)
    return SpeechCheck(
        passed=not failures, failures=failures, recording=given.recording, encoder_cosine=cosine,
        kl_mean=float(kl[scored].mean()), kl_max=float(kl[scored].max()), top1=top1, transcript=text,
        eager_transcript=eager_text, unquantized_transcript=unquantized_text, identical=program_tokens == eager_tokens,
        wer_vs_eager=word_error_rate(eager_text, text), wer_vs_unquantized=word_error_rate(unquantized_text, text),
        tolerance={"min_encoder_cosine": MIN_ENCODER_COSINE, "max_kl": tolerance.max_kl,
                   "min_top1": tolerance.min_top1})
