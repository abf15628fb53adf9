"""Validate: run the written ``.pte`` over the validation text and compare it with the eager model.

The program goes over the windows the ``reference`` stage made, the way generation drives it (prompt
method, then one token per step through the step method), and the eager model quantized the same
way over the same tokens; the measures are in :mod:`exporters.runtime.quality`. Both sides keep their own
KV cache, so a runtime cache that does not carry from prefill to decode shows up as a large KL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exporters.stages.artifacts import EmittedProgram, ValidatedProgram
from exporters.manifest import ValidationReport
from exporters.config import QuantConfig
from exporters.runtime.driver import Driver, MethodRoles
from exporters.stages.pipeline import Stage
from exporters.runtime.quality import Agreement, TextWindows, full_sequence, negative_log_likelihood, perplexity, window_logits
from exporters.runtime.programs import CapturedPrograms, LoadedProgram


@dataclass(frozen=True)
class Tolerance:
    max_kl: float
    min_top1: float
    max_ppl_increase: float

    @staticmethod
    def of(quant: QuantConfig) -> "Tolerance":
        return Tolerance(quant.max_kl, quant.min_top1, quant.max_ppl_increase)


def program_predictions(driver: Driver, window: torch.Tensor, prompt_tokens: int) -> torch.Tensor:
    """The program's predictions for one window [L - P, V]: the prompt at once, then one token per step."""
    rows = [driver.prefill(window[:, :prompt_tokens])]
    rows += [driver.decode_one_token(window[:, i:i + 1], i) for i in range(prompt_tokens, window.shape[1] - 1)]
    return torch.cat(rows).float()


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
        roles = MethodRoles.choose({name: spec.shape for name, spec in emitted.specs.items()})
        if self.runs_here:
            program: LoadedProgram | CapturedPrograms = LoadedProgram(emitted.path)
        else:
            assert emitted.reference_programs is not None, "capture keeps reference programs for such backends"
            program = CapturedPrograms(emitted.reference_programs, emitted.quantized.model.kv_cache_buffers())

        model = emitted.quantized.model
        with torch.no_grad():
            eager = window_logits(full_sequence(model), text)
            driver = Driver(program, roles)
            ours = [program_predictions(driver, w, text.prompt_tokens) for w in text.windows]
            forward_kl = self._forward_against_prefill(program, roles, emitted, text)
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
            methods={"prompt": roles.prompt, "step": roles.step,
                     "forward": "checked against prefill" if forward_kl is not None else None},
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
    def _forward_against_prefill(program: LoadedProgram | CapturedPrograms, roles: MethodRoles, emitted: EmittedProgram,
                                 text: TextWindows) -> float | None:
        """``forward`` (what the stock runner calls) on the first prompt, against ``prefill`` on the same tokens."""
        by_kind = {spec.kind: name for name, spec in emitted.specs.items()}
        if not {"prefill", "forward"} <= by_kind.keys():
            return None
        prompt = text.windows[0][:, :text.prompt_tokens]
        by_method = [Driver(program, roles.with_prompt(by_kind[k], emitted.specs[by_kind[k]].shape)).prefill(prompt)
                     for k in ("prefill", "forward")]
        return float(Agreement.of(*by_method).kl.max())
