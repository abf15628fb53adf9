"""Transcription with an exported speech program, as an app does it: ``preprocessor.pte`` turns the recording's
samples into log-mel windows, ``encoder`` runs once per window, ``text_decoder`` once per token (the stock
``AsrRunner``'s calls), greedy with the checkpoint's suppressed tokens; the manifest gives the tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from exporters.errors import UserError
from exporters.manifest import Manifest, SpeechEntry
from exporters.program.speech import PREPROCESSOR_FILE, SpeechTokens
from exporters.runtime.audio import Recording, detect_language, greedy
from exporters.runtime.programs import LoadedProgram
from models.whisper import ENCODER, TEXT_DECODER

TASKS = ("transcribe", "translate")


def speech_entry(manifest: Manifest) -> SpeechEntry | None:
    return next((c.speech for c in manifest.components.values() if c.speech is not None), None)


@dataclass(frozen=True)
class TranscriptResult:
    text: str
    tokens: list[int]
    language: str | None  # the language code used (given, or detected on the first window)
    windows: int
    seconds: float  # of audio
    preprocess_s: float
    encode_s: float
    decode_s: float

    @property
    def real_time_factor(self) -> float:
        """Processing time over the audio's length (below 1: faster than real time)."""
        return (self.preprocess_s + self.encode_s + self.decode_s) / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s else 0.0


class Transcriber:
    """A speech program's run folder, loaded once."""

    def __init__(self, folder: Path, entry: SpeechEntry, pte: Path) -> None:
        from tokenizers import Tokenizer

        self.folder, self.entry = folder, entry
        t = entry.tokens
        self.tokens = SpeechTokens(start=t["start"], end=t["end"], transcribe=t["transcribe"], translate=t["translate"],
                                   no_timestamps=t["no_timestamps"], languages=dict(t["languages"]),
                                   suppress=tuple(t.get("suppress", ())), suppress_at_begin=tuple(t.get("suppress_at_begin", ())))
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise UserError(f"{folder}: tokenizer.json is missing beside the program: it came with the export. Copy "
                            "the whole run folder.")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        preprocessor = folder / (entry.preprocessor or PREPROCESSOR_FILE)
        if not preprocessor.is_file():
            raise UserError(f"{folder}: {preprocessor.name} is missing beside the program: it came with the export "
                            "and turns a recording into the encoder's input. Copy the whole run folder.")
        started = time.perf_counter()
        self.program = LoadedProgram(pte)
        self.program.load(ENCODER, TEXT_DECODER)
        self.preprocessor = LoadedProgram(preprocessor)
        self.load_seconds = time.perf_counter() - started
        # Tokens one text_decoder call takes at most: ours a prompt's; a program with fixed one-token calls
        # (optimum-executorch's) is fed the prompt one token at a time.
        self.tokens_per_call = self.program.inputs_of(TEXT_DECODER)[0][0][1]

    def check(self, language: str | None, task: str) -> None:
        if task not in TASKS:
            raise UserError(f"task={task}: give one of {', '.join(TASKS)}.")
        if task == "translate" and self.tokens.translate is None:
            raise UserError("task=translate: this checkpoint is English-only (it has no task tokens). Use "
                            "task=transcribe.")
        if language not in (None, "auto") and language not in self.tokens.languages:
            known = ", ".join(sorted(self.tokens.languages)) or "none (an English-only checkpoint)"
            raise UserError(f"language={language}: not one of this checkpoint's languages: {known}; or language=auto "
                            "(detected from the first window).")

    def transcribe(self, recording: Recording, language: str | None = None, task: str = "transcribe",
                   max_new_tokens: int | None = None) -> TranscriptResult:
        """Every 30 s window of ``recording`` transcribed in turn (``language``: a code, or None/auto: detected on
        the first window)."""
        self.check(language, task)
        started = time.perf_counter()
        windows = self.preprocessor.run("forward", torch.from_numpy(recording.samples))[0]
        preprocess_s = time.perf_counter() - started
        encode_s = decode_s = 0.0
        tokens: list[int] = []
        code = language if language not in (None, "auto") else None
        for window in windows:
            started = time.perf_counter()
            states = self.program.run(ENCODER, window[None].contiguous())[0]
            encode_s += time.perf_counter() - started
            started = time.perf_counter()
            decoder = self._decoder()
            if code is None and self.tokens.languages:
                found = detect_language(decoder, states, self.tokens)
                code = next(c for c, i in self.tokens.languages.items() if i == found)
            prompt = self.tokens.prompt(self.tokens.languages.get(code) if code else None, task)
            budget = self.entry.max_tokens - len(prompt)
            tokens += greedy(decoder, states, prompt, self.tokens, min(budget, max_new_tokens or budget))
            decode_s += time.perf_counter() - started
        return TranscriptResult(self.tokenizer.decode(tokens, skip_special_tokens=True), tokens, code,
                                len(windows), recording.seconds, preprocess_s, encode_s, decode_s)

    def _decoder(self):  # type: ignore[no-untyped-def]
        def run(ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            """The logits of the call's last token (all greedy decoding reads)."""
            step = self.tokens_per_call
            for start in range(0, ids.shape[1], step):
                logits = self.program.run(TEXT_DECODER, ids[:, start:start + step], states,
                                          positions[start:start + step])[0]
            return logits

        return run
