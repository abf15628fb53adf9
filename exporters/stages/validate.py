"""Validate: run the written ``.pte`` and compare it step by step with the eager model it came from.

Prefill on a fixed prompt, then N decode steps fed the eager model's greedy tokens (teacher forcing),
so each step compares logits for identical inputs; both sides use their own KV cache, so a runtime
cache that does not carry over between methods shows up as a large error.
"""

from __future__ import annotations

from typing import Any

import torch

from exporters.artifacts import EmittedProgram, ValidatedProgram, ValidationReport
from exporters.config import QuantConfig, ValidationConfig
from exporters.methods import MethodSpec
from exporters.pipeline import Stage
from exporters.runtime import CapturedPrograms, LoadedProgram
from models.tokenizer import find_tokenizer, load_tokenizer


def prompt_tokens(emitted: EmittedProgram, prompt: str, limit: int) -> torch.Tensor:
    """The validation prompt as ids (bos first), from the checkpoint's tokenizer when it has one."""
    ckpt = emitted.quantized.loaded.checkpoint
    vocab = emitted.quantized.model.args.vocab_size
    tok_file = find_tokenizer(ckpt.path)
    if tok_file is not None:
        ids = load_tokenizer(tok_file).encode(prompt)
    else:  # random-init models have no tokenizer: a fixed, spread-out id sequence
        ids = [(7919 * i + 13) % vocab for i in range(len(prompt.split()) * 2)]
    if ckpt.bos_id is not None:
        ids = [ckpt.bos_id] + ids
    return torch.tensor([ids[:limit]], dtype=torch.int64)


def prompt_chunks(tokens: torch.Tensor, spec: MethodSpec) -> list[torch.Tensor]:
    """Split the prompt into calls the method accepts: one dynamic call, fixed-size chunks, or single tokens."""
    if not spec.dynamic and spec.min_tokens > 1:  # static prefill: whole chunks, the first padded if short
        if tokens.shape[1] < spec.min_tokens:
            tokens = torch.cat([tokens, tokens[:, -1:].expand(1, spec.min_tokens - tokens.shape[1])], dim=1)
        usable = tokens.shape[1] - tokens.shape[1] % spec.min_tokens
        tokens = tokens[:, :usable]
    return list(torch.split(tokens, spec.max_tokens, dim=1))


def _compare(step: str, got: torch.Tensor, ref: torch.Tensor, max_rel_error: float) -> dict[str, Any]:
    """Errors of one step, and whether the runtime's greedy token agrees with the eager model's.

    A different token counts as agreeing when the eager model scores it within the error tolerance
    of its own best token: a near-tie flipped by allowed rounding is not a wrong program (random-weight
    models are full of near-ties).
    """
    got, ref = got.float().reshape(ref.shape), ref.float()
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item() or 1.0
    last = ref.reshape(-1, ref.shape[-1])[-1]
    runtime_token = int(got.reshape(-1, got.shape[-1])[-1].argmax())
    eager_token = int(last.argmax())
    margin = (last[eager_token] - last[runtime_token]).item()
    return {
        "step": step,
        "max_abs_error": err,
        "max_rel_error": err / scale,
        "runtime_token": runtime_token,
        "eager_token": eager_token,
        "eager_margin": margin,
        "agrees": runtime_token == eager_token or margin <= max_rel_error * scale,
    }


class ValidateStage(Stage):
    name = "validate"

    def __init__(self, validation_cfg: ValidationConfig, quant_cfg: QuantConfig, enabled: bool,
                 runs_here: bool = True) -> None:
        self.cfg = validation_cfg
        self.runs_here = runs_here
        self.tolerance = {"max_rel_error": quant_cfg.max_rel_error, "min_token_agreement": quant_cfg.min_token_agreement}
        self.enabled = enabled

    def run(self, emitted: EmittedProgram) -> ValidatedProgram:
        if not self.enabled:
            return ValidatedProgram(emitted=emitted, report=None)
        return ValidatedProgram(emitted=emitted, report=self.compare(emitted))

    def compare(self, emitted: EmittedProgram) -> ValidationReport:
        specs = emitted.specs
        prompt_method = next(m for m in ("prefill", "forward", "decode") if m in specs)
        step_method = next((m for m in ("decode", "forward", "prefill") if m in specs and specs[m].min_tokens == 1),
                           None)
        steps = self.cfg.decode_steps if step_method else 0
        max_seq_len = emitted.quantized.loaded.max_seq_len
        chunks = prompt_chunks(prompt_tokens(emitted, self.cfg.prompt, max_seq_len - steps - 1), specs[prompt_method])

        model = emitted.quantized.model
        tol = self.tolerance["max_rel_error"]
        if self.runs_here:
            program: LoadedProgram | CapturedPrograms = LoadedProgram(emitted.path)
        else:
            assert emitted.reference_programs is not None, "capture keeps reference programs for such backends"
            program = CapturedPrograms(emitted.reference_programs, model.kv_cache_buffers())
        model.reset_cache()
        records = []
        position = 0
        with torch.no_grad():
            for i, chunk in enumerate(chunks):
                pos = torch.tensor([position])
                ref = model(chunk, pos)
                name = prompt_method if len(chunks) == 1 else f"{prompt_method}[{i}]"
                records.append(_compare(name, program.run(prompt_method, chunk, pos)[0], ref, tol))
                position += chunk.shape[1]
            for i in range(steps):
                token = ref.argmax(-1).reshape(1, 1)
                pos = torch.tensor([position])
                ref = model(token, pos)
                records.append(_compare(f"{step_method}[{i}]", program.run(step_method, token, pos)[0], ref, tol))
                position += 1
        model.reset_cache()

        prompt_len = sum(c.shape[1] for c in chunks)
        max_rel = max(r["max_rel_error"] for r in records)
        agreement = sum(r["agrees"] for r in records) / len(records)
        exact = sum(r["runtime_token"] == r["eager_token"] for r in records) / len(records)
        return ValidationReport(
            passed=max_rel <= self.tolerance["max_rel_error"] and agreement >= self.tolerance["min_token_agreement"],
            prompt_tokens=prompt_len,
            decode_steps=steps,
            max_abs_error=max(r["max_abs_error"] for r in records),
            max_rel_error=max_rel,
            token_agreement=agreement,
            exact_token_agreement=exact,
            per_step=records,
            tolerance=self.tolerance,
            checked="runtime" if self.runs_here else "captured programs (delegate cannot run on this host)",
        )
