"""Validate: run the written ``.pte`` over the validation text and compare it with the eager model.

The program goes over the windows the ``reference`` stage made, the way generation drives it (prompt
method, then one token per step through the step method), and the eager model quantized the same
way over the same tokens; the measures are in :mod:`exporters.quality`. Both sides keep their own
KV cache, so a runtime cache that does not carry from prefill to decode shows up as a large KL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exporters.artifacts import EmittedProgram, ValidatedProgram, ValidationReport
from exporters.config import QuantConfig
from exporters.errors import UserError
from exporters.methods import MethodSpec
from exporters.pipeline import Stage
from exporters.quality import Agreement, TextWindows, full_sequence, negative_log_likelihood, perplexity, window_logits
from exporters.runtime import CapturedPrograms, LoadedProgram


@dataclass(frozen=True)
class Tolerance:
    max_kl: float
    min_top1: float
    max_ppl_increase: float

    @staticmethod
    def of(quant: QuantConfig) -> "Tolerance":
        return Tolerance(quant.max_kl, quant.min_top1, quant.max_ppl_increase)


def choose_methods(specs: dict[str, MethodSpec]) -> tuple[str, str]:
    """The prompt method (prefill, else forward, else decode) and the one-token step method."""
    prompt = next(m for m in ("prefill", "forward", "decode") if m in specs)
    step = next((m for m in ("decode", "forward", "prefill") if m in specs and specs[m].min_tokens == 1), None)
    if step is None:
        raise UserError(
            f"validation steps one token at a time, and none of export.methods={list(specs)} takes one token "
            "(static-shape prefill only). Add decode to export.methods, or set validate=false."
        )
    return prompt, step


def program_predictions(program: LoadedProgram | CapturedPrograms, window: torch.Tensor, prompt_tokens: int,
                        prompt: str, prompt_spec: MethodSpec, step: str) -> torch.Tensor:
    """The program's predictions for one window [L - P, V]: the prompt at once, then one token per step."""
    rows = []
    position = 0
    for chunk in torch.split(window[:, :prompt_tokens], prompt_spec.max_tokens, dim=1):
        out = program.run(prompt, chunk, torch.tensor([position]))[0]
        position += chunk.shape[1]
    rows.append(out.reshape(-1, out.shape[-1])[-1])
    for i in range(prompt_tokens, window.shape[1] - 1):
        rows.append(program.run(step, window[:, i:i + 1], torch.tensor([i]))[0].reshape(-1))
    return torch.stack(rows).float()


class ValidateStage(Stage):
    name = "validate"

    def __init__(self, tolerance: Tolerance, enabled: bool, runs_here: bool = True) -> None:
        self.tolerance = tolerance
        self.enabled = enabled
        self.runs_here = runs_here

    def run(self, emitted: EmittedProgram) -> ValidatedProgram:
        if not self.enabled:
            return ValidatedProgram(emitted=emitted, report=None)
        return ValidatedProgram(emitted=emitted, report=self.compare(emitted))

    def compare(self, emitted: EmittedProgram) -> ValidationReport:
        reference = emitted.quantized.loaded.reference
        assert reference is not None, "the reference stage runs whenever validation does"
        text: TextWindows = reference.text
        prompt, step = choose_methods(emitted.specs)
        if self.runs_here:
            program: LoadedProgram | CapturedPrograms = LoadedProgram(emitted.path)
        else:
            assert emitted.reference_programs is not None, "capture keeps reference programs for such backends"
            program = CapturedPrograms(emitted.reference_programs, emitted.quantized.model.kv_cache_buffers())

        model = emitted.quantized.model
        with torch.no_grad():
            eager = window_logits(full_sequence(model), text)
            ours = [program_predictions(program, w, text.prompt_tokens, prompt, emitted.specs[prompt], step)
                    for w in text.windows]
            forward_kl = self._forward_against_prefill(program, emitted, text)
        model.reset_cache()

        per_window = []
        nll_eager = nll_program = 0.0
        for i, (window, e, p) in enumerate(zip(text.windows, eager, ours)):
            a = Agreement.of(e, p)
            ne, np_ = negative_log_likelihood(e, text.targets(window)), negative_log_likelihood(p, text.targets(window))
            nll_eager, nll_program = nll_eager + ne, nll_program + np_
            per_window.append({"window": i, "tokens": window.shape[1], "kl_mean": float(a.kl.mean()),
                               "kl_max": float(a.kl.max()), "top1_agreement": float(a.top1.double().mean()),
                               "max_abs_error": a.max_abs_error})
        total = Agreement.of(torch.cat(eager), torch.cat(ours))
        n = text.scored_tokens
        ppl_program, ppl_eager = perplexity(nll_program, n), perplexity(nll_eager, n)
        t = self.tolerance
        kl_mean, top1 = float(total.kl.mean()), float(total.top1.double().mean())
        failures = [
            *([f"KL {kl_mean:.3g} > {t.max_kl:.3g}"] if kl_mean > t.max_kl else []),
            *([f"top-1 agreement {top1:.1%} < {t.min_top1:.0%}"] if top1 < t.min_top1 else []),
            *([f"perplexity {ppl_program:.4g} > eager {ppl_eager:.4g} x (1 + {t.max_ppl_increase:.3g})"]
              if ppl_program > ppl_eager * (1 + t.max_ppl_increase) else []),
            *([f"forward differs from prefill: KL {forward_kl:.3g} > {t.max_kl:.3g}"]
              if forward_kl is not None and forward_kl > t.max_kl else []),
        ]
        return ValidationReport(
            passed=not failures,
            failures=failures,
            checked="runtime" if self.runs_here else "captured programs (delegate cannot run on this host)",
            text=text.source,
            methods={"prompt": prompt, "step": step, "forward": "checked against prefill" if forward_kl is not None else None},
            windows=len(text.windows),
            prompt_tokens=text.prompt_tokens,
            scored_tokens=n,
            kl_mean=kl_mean,
            kl_max=float(total.kl.max()),
            top1_agreement=top1,
            top5_overlap=float(total.topk_overlap.mean()),
            max_abs_error=total.max_abs_error,
            max_rel_error=total.max_rel_error,
            perplexity=ppl_program,
            eager_perplexity=ppl_eager,
            reference_perplexity=reference.perplexity,
            reference_dtype=reference.dtype,
            forward_kl=forward_kl,
            tolerance={"max_kl": t.max_kl, "min_top1": t.min_top1, "max_ppl_increase": t.max_ppl_increase},
            per_window=per_window,
        )

    @staticmethod
    def _forward_against_prefill(program: LoadedProgram | CapturedPrograms, emitted: EmittedProgram,
                                 text: TextWindows) -> float | None:
        """``forward`` (what the stock runner calls) on the first prompt, against ``prefill`` on the same tokens."""
        specs = emitted.specs
        if not {"prefill", "forward"} <= specs.keys():
            return None
        window = text.windows[0]
        by_method = [program_predictions(program, window[:, :text.prompt_tokens + 1], text.prompt_tokens, m,
                                         specs[m], m)[:1] for m in ("prefill", "forward")]
        return float(Agreement.of(*by_method).kl.max())
