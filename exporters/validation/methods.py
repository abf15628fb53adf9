"""A language model's methods against its eager model on the validation text: what validation runs per component.

The program goes over the windows the ``baseline`` stage made, the way generation drives it (prompt method,
then one token per step through the step method), and so does the eager model quantized the same way; the
measures are in :mod:`exporters.runtime.quality`. Both sides keep their own KV cache, so a runtime cache that
does not carry from prefill to decode shows up as a large KL. Four steps, one function each: run both
sides (:func:`predictions`), score them (:class:`Scores`), judge the scores against the tolerance
(:func:`judge`), and write the report (:func:`report`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from exporters.config import KvDType
from exporters.manifest import SpeculativeCheck, ValidationReport
from exporters.plan.validation import Tolerance
from exporters.program.methods import MethodSpec
from exporters.runtime.driver import Driver, MethodRoles
from exporters.runtime.programs import CapturedPrograms, LoadedProgram
from exporters.runtime.quality import Agreement, TextWindows, full_sequence, perplexity, window_logits
from exporters.runtime.speculative import Proposer
from exporters.validation.speculative import speculative_check
from exporters.validation.under_test import ProgramUnderTest
from models.decoder import CausalLM
from models.lora import active_adapter

log = logging.getLogger("exporters")


@dataclass(frozen=True)
class Predictions:
    """Per window, the next-token logits [L - P, V] of the eager model and of the program; and ``forward``
    against ``prefill`` on the first prompt (None when the program lacks either)."""

    eager: list[torch.Tensor]
    program: list[torch.Tensor]
    forward_kl: float | None
    # token_embedding -> text_decoder (ExecuTorch's MultimodalRunner's path) over the first window against the prompt
    # and step methods, when the program has both paths.
    text_decoder_kl: float | None = None


@dataclass(frozen=True)
class Scores:
    agreement: Agreement  # over every scored position
    per_window: list[dict[str, float]]
    perplexity: float  # of the program
    eager_perplexity: float
    scored: int  # the targets perplexity is over: all, or those a draft's restricted head scores

    @staticmethod
    def of(predictions: Predictions, text: TextWindows, columns: torch.Tensor | None = None) -> "Scores":
        """``columns``: the token of each logit when the head scores a few (a draft's ``draft.vocab``)."""
        per_window, parts = [], []
        for i, (window, e, p) in enumerate(zip(text.windows, predictions.eager, predictions.program)):
            a = Agreement.of(e, p)
            parts.append(a)
            per_window.append({"window": i, "tokens": window.shape[1], "kl_mean": float(a.kl.mean()),
                               "kl_max": float(a.kl.max()), "top1_agreement": float(a.top1.double().mean()),
                               "max_abs_error": a.max_abs_error})
        n = text.scored(columns)
        return Scores(Agreement.joined(parts), per_window, perplexity(text.nll(predictions.program, columns), n),
                      perplexity(text.nll(predictions.eager, columns), n), n)

    @property
    def kl_mean(self) -> float:
        return float(self.agreement.kl.mean())

    @property
    def top1(self) -> float:
        return float(self.agreement.top1.double().mean())


def program_predictions(driver: Driver, window: torch.Tensor, prompt_tokens: int) -> torch.Tensor:
    """The program's predictions for one window [L - P, V]: the prompt at once, then one token per step."""
    rows = [driver.prefill(window[:, :prompt_tokens])]
    rows += [driver.decode_one_token(window[:, i:i + 1], i) for i in range(prompt_tokens, window.shape[1] - 1)]
    return torch.cat(rows).float()


def forward_against_prefill(program: LoadedProgram | CapturedPrograms, roles: MethodRoles,
                            specs: dict[str, MethodSpec], text: TextWindows) -> float | None:
    """``forward`` (what the stock runner calls) on the first prompt, against ``prefill`` on the same tokens."""
    by_kind = {spec.kind: name for name, spec in specs.items()}
    if not {"prefill", "forward"} <= by_kind.keys():
        return None
    prompt = text.windows[0][:, :text.prompt_tokens]
    by_method = [Driver(program, roles.with_prompt(by_kind[k], specs[by_kind[k]].shape)).prefill(prompt)
                 for k in ("prefill", "forward")]
    return float(Agreement.of(*by_method).kl.max())


def text_decoder_against_prompt_methods(program: LoadedProgram | CapturedPrograms, roles: MethodRoles,
                                        specs: dict[str, MethodSpec], text: TextWindows,
                                        theirs: torch.Tensor) -> float | None:
    """token_embedding then text_decoder over the first window (the prompt at once, then each token: how
    ExecuTorch's MultimodalRunner drives the text), against ``theirs``, the prompt and step methods' predictions."""
    shapes = {name: spec.shape for name, spec in specs.items()}
    kinds = {shape.kind for shape in shapes.values()}
    if roles.embed is not None or not {"token_embedding", "text_decoder"} <= kinds:
        return None
    pair = Driver(program, MethodRoles.through_embeddings(shapes))
    return float(Agreement.of(theirs, program_predictions(pair, text.windows[0], text.prompt_tokens)).kl.max())


def driven(program: LoadedProgram | CapturedPrograms, roles: MethodRoles, text: TextWindows,
           side: str) -> list[torch.Tensor]:
    """Every window through ``program``'s methods, as generation drives them."""
    driver = Driver(program, roles)
    found = []
    for i, w in enumerate(text.windows, start=1):
        found.append(program_predictions(driver, w, text.prompt_tokens))
        if len(text.windows) > 1:
            log.info("  validate: %s window %d/%d (%d tokens)", side, i, len(text.windows), w.shape[1])
    return found


def predictions(model: CausalLM, under: ProgramUnderTest, roles: MethodRoles, specs: dict[str, MethodSpec],
                adapter: str | None = None, side: str = "program") -> Predictions:
    """The eager model's and the program's predictions; ``adapter``: the eager side applies it (the program's
    side is in ``roles``: that adapter's methods). With ``under.eager_graphs`` the eager side is those captured
    programs (PT2E: the quantized model exists only as graphs), driven like the program."""
    program, text, eager_graphs = under.program, under.text, under.eager_graphs
    with torch.no_grad():
        if eager_graphs is not None:
            eager = driven(eager_graphs, roles, text, "eager")
        else:
            with active_adapter(model, adapter), model.kv_dtype_as(KvDType.fp32):
                eager = window_logits(full_sequence(model), text)
        # The undelegated programs standing in for a delegate that cannot run here may be the eager side itself.
        ours = eager if program is eager_graphs else driven(program, roles, text, side)
        forward_kl = forward_against_prefill(program, roles, specs, text)
        text_decoder_kl = text_decoder_against_prompt_methods(program, roles, specs, text, ours[0])
    model.reset_cache()
    return Predictions(eager, ours, forward_kl, text_decoder_kl)


def judge(scores: Scores, found: Predictions, t: Tolerance,
          speculative: SpeculativeCheck | None = None) -> list[str]:
    """Each measure outside its tolerance, with its value and limit (empty: the program passes)."""
    return [
        *([f"verify differs from the eager model: KL {speculative.verify_kl:.3g} > {t.max_kl:.3g}"]
          if speculative is not None and speculative.verify_kl > t.max_kl else []),
        *([f"speculative greedy decoding ({speculative.proposer}, verify) differs from plain greedy decoding at token "
           f"{speculative.diverged_at}, where plain decoding's top two logits were {speculative.margin_there:.3g} apart: "
           f"more than {speculative.tie_factor:g} x the {speculative.kernel_noise:.3g} verify and decode differ by"]
          if speculative is not None and not speculative.matches else []),
        *([f"KL {scores.kl_mean:.3g} > {t.max_kl:.3g}"] if scores.kl_mean > t.max_kl else []),
        *([f"top-1 agreement {scores.top1:.1%} < {t.min_top1:.0%}"] if scores.top1 < t.min_top1 else []),
        *([f"perplexity {scores.perplexity:.4g} > eager {scores.eager_perplexity:.4g} x (1 + {t.max_ppl_drift:.3g})"]
          if scores.perplexity > scores.eager_perplexity * (1 + t.max_ppl_drift) else []),
        *([f"forward differs from prefill: KL {found.forward_kl:.3g} > {t.max_kl:.3g}"]
          if found.forward_kl is not None and found.forward_kl > t.max_kl else []),
        *([f"token_embedding -> text_decoder differs from the prompt and step methods: KL "
           f"{found.text_decoder_kl:.3g} > {t.max_kl:.3g}"]
          if found.text_decoder_kl is not None and found.text_decoder_kl > t.max_kl else []),
    ]


@dataclass(frozen=True)
class Judged:
    """One set of methods checked: what both sides predicted, the scores, speculation's check, what failed."""

    found: Predictions
    scores: Scores
    roles: MethodRoles
    failures: list[str]
    speculative: SpeculativeCheck | None = None
    against_unquantized: Agreement | None = None  # the program against the unquantized model, where it was kept


def report(judged: Judged, under: ProgramUnderTest, t: Tolerance, unquantized: float | None = None,
           eager_kv_dtype: str | None = None) -> ValidationReport:
    """``unquantized``: the perplexity of the unquantized model these methods compute (an adapter's, a draft's;
    None: the decoder's own, ``baseline.perplexity``)."""
    scores, found, roles, failures = judged.scores, judged.found, judged.roles, judged.failures
    baseline, speculative, checked, runs_in = under.baseline, judged.speculative, under.checked, under.runs_in
    text, total = baseline.text, scores.agreement
    return ValidationReport(
        passed=not failures,
        failures=failures,
        checked=checked,
        text=text.source,
        methods={"prompt": roles.prompt, "step": roles.step,
                 "forward": "checked against prefill" if found.forward_kl is not None else None,
                 **({"embeddings": roles.embed} if roles.embed else {}),
                 **({"text_decoder": "token_embedding -> text_decoder checked against prompt and step"}
                    if found.text_decoder_kl is not None else {})},
        windows=len(text.windows),
        prompt_tokens=text.prompt_tokens,
        scored_tokens=scores.scored,
        kl_mean=scores.kl_mean,
        kl_max=float(total.kl.max()),
        top1_agreement=scores.top1,
        top5_overlap=float(total.topk_overlap.mean()),
        max_abs_error=total.max_abs_error,
        max_rel_error=total.max_rel_error,
        perplexity=scores.perplexity,
        eager_perplexity=scores.eager_perplexity,
        baseline_perplexity=baseline.perplexity if unquantized is None else unquantized,
        baseline_dtype=baseline.dtype,
        forward_kl=found.forward_kl,
        text_decoder_kl=found.text_decoder_kl,
        tolerance={"max_kl": t.max_kl, "min_top1": t.min_top1, "max_ppl_drift": t.max_ppl_drift},
        runs_in=str(runs_in) if runs_in is not None else None,
        per_window=scores.per_window,
        eager_kv_dtype=eager_kv_dtype,
        speculative=speculative,
        kl_vs_unquantized=float(judged.against_unquantized.kl.mean()) if judged.against_unquantized else None,
        top1_vs_unquantized=(float(judged.against_unquantized.top1.double().mean()) if judged.against_unquantized
                             else None),
    )


def against(reference: list[torch.Tensor], program: list[torch.Tensor]) -> Agreement:
    """The program's predictions against ``reference``'s (the unquantized model's), window by window."""
    return Agreement.joined([Agreement.of(r, p) for r, p in zip(reference, program)])


def validate_methods(model: CausalLM, under: ProgramUnderTest, specs: dict[str, MethodSpec],
                     adapter: str | None = None, unquantized: float | None = None,
                     proposer: Callable[[Any], Proposer] | None = None,
                     unquantized_logits: list[torch.Tensor] | None = None) -> ValidationReport:
    """The decoder's methods ``specs`` (with ``adapter`` applied on the eager side) against its eager model, and verify
    with speculation when they include it (``proposer``: makes the program's draft proposer from the program; else
    lookup); ``unquantized``: the unquantized perplexity with that adapter (None: the base's);
    ``unquantized_logits``: the unquantized model's predictions, which the program is compared with too."""
    roles = MethodRoles.choose({name: spec.shape for name, spec in specs.items()})
    found = predictions(model, under, roles, specs, adapter, side=f"adapter {adapter}" if adapter else "program")
    scores = Scores.of(found, under.text)
    speculative = speculative_check(model, under, roles, adapter, proposer) if roles.verify else None
    judged = Judged(found, scores, roles, judge(scores, found, under.tolerance, speculative), speculative,
                    against(unquantized_logits, found.program) if unquantized_logits is not None else None)
    return report(judged, under, under.tolerance, unquantized, under.eager_kv_dtype)
