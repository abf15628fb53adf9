"""The check of a program's ``verify``: against the eager model, and speculative greedy decoding against plain.

Exact where it can be: greedy decoding with speculation (a draft's methods, else lookup) must give the tokens plain
greedy decoding gives. Where the two differ, the divergence is judged a tie when plain decoding's top two logits there
were closer than :data:`TIE_FACTOR` times the largest difference between verify's and the one-token method's logits
(the batched kernels round differently from the single-token ones).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from exporters.config import KvDType
from exporters.manifest import SpeculativeCheck
from exporters.runtime.driver import Driver, MethodRoles
from exporters.runtime.quality import Agreement, full_sequence
from exporters.runtime.sampling import SamplingConfig
from exporters.runtime.speculative import (LookupProposer, Observers, Proposer, Speculation, Stops,
                                           continue_text, pad_with_last)
from exporters.validation.under_test import ProgramUnderTest
from models.decoder import CausalLM
from models.lora import active_adapter

#: Greedy tokens the speculative check generates each way (plain and speculative) from the first prompt.
SPECULATIVE_TOKENS = 24

#: A divergence of speculative from plain greedy decoding is a tie when plain decoding's top two logits there were
#: closer than this many times the largest difference between verify's and the one-token method's logits.
TIE_FACTOR = 4.0


class PlainLogits:
    """Told the logits each token of plain greedy decoding was chosen from: the rows, and their top-two margins."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.margins: list[float] = []

    def __call__(self, logits: torch.Tensor) -> None:
        row = logits.float().reshape(-1)
        self.rows.append(row)
        top = row.topk(2).values
        self.margins.append(float(top[0] - top[1]))


def verify_against_eager(model: CausalLM, driver: Driver, window: torch.Tensor, prompt: int,
                         adapter: str | None) -> tuple[Agreement, float]:
    """verify on the text's own next tokens after the prompt (as if all were proposed) against the eager model's
    logits at the same positions, and the largest difference from the one-token method's logits on them."""
    k = driver.roles.verify_tokens - 1
    with torch.no_grad(), active_adapter(model, adapter), model.kv_dtype_as(KvDType.fp32):
        eager = full_sequence(model)(window)  # [L, V]: row i follows token i
    model.reset_cache()
    checked = window[0, prompt:prompt + k + 1].tolist()
    driver.prefill(window[:, :prompt])
    ours = driver.verify(pad_with_last(checked, k + 1), prompt).float()[:len(checked)]
    driver.prefill(window[:, :prompt])
    stepwise = torch.cat([driver.decode_one_token(t, prompt + j) for j, t in enumerate(checked)]).float()
    return Agreement.of(eager[prompt:prompt + len(checked)], ours), float((stepwise - ours).abs().max())


def verify_drift(driver: Driver, window: torch.Tensor, prompt: int, plain: list[int], seen: PlainLogits,
                 context: int) -> float:
    """Plain decoding's tokens through verify calls alone (every proposal kept): the cache written by the batched
    kernels, as in speculation. Under dynamically quantized activations a last-bit difference in one cached entry can
    flip an int8 rounding later, so this trajectory, not one call, measures how far the two paths drift apart."""
    k, noise = driver.roles.verify_tokens - 1, 0.0
    driver.prefill(window[:, :prompt])
    for start in range(0, len(plain) - 1, k + 1):
        fed = plain[start:start + k + 1]
        if prompt + start + k >= context:
            break
        rows = driver.verify(pad_with_last(fed, k + 1), prompt + start).float()
        for j in range(min(len(fed), len(seen.rows) - start - 1)):
            noise = max(noise, float((rows[j] - seen.rows[start + j + 1]).abs().max()))
    return noise


def speculative_check(model: CausalLM, under: ProgramUnderTest, roles: MethodRoles, adapter: str | None = None,
                      proposer: Callable[[Any], Proposer] | None = None) -> SpeculativeCheck:
    """verify on the first window after its prompt (:func:`verify_against_eager`); then greedy generation from that
    prompt with speculation (``proposer``: makes the program's draft proposer from the program; else lookup)
    against without, in the program."""
    program, window, prompt = under.program, under.text.windows[0], under.text.prompt_tokens
    driver = Driver(program, roles)
    agreement, noise = verify_against_eager(model, driver, window, prompt, adapter)
    ids, greedy, seen = window[0, :prompt].tolist(), SamplingConfig(max_new_tokens=SPECULATIVE_TOKENS), PlainLogits()
    speculator: Proposer = proposer(program) if proposer is not None else LookupProposer()
    runs = {}
    for speculating in (False, True):
        first = driver.prefill(window[:, :prompt])
        runs[speculating] = continue_text(driver, ids, first, greedy, Stops(set(), under.context),
                                          Speculation(speculator) if speculating else None,
                                          Observers(seen=None if speculating else seen))
    plain, fast, stats = runs[False][0], runs[True][0], runs[True][2]
    assert stats is not None
    noise = max(noise, verify_drift(driver, window, prompt, plain, seen, under.context))
    diverged = next((i for i, (a, b) in enumerate(zip(plain, fast)) if a != b), None)
    return SpeculativeCheck(
        verify_kl=float(agreement.kl.mean()), verify_top1=float(agreement.top1.double().mean()), tokens=len(plain),
        identical=plain == fast, proposer=speculator.name, acceptance=round(stats.acceptance, 4),
        tokens_per_call=round(stats.tokens_per_call, 4), kernel_noise=noise, diverged_at=diverged,
        margin_there=None if diverged is None else seen.margins[diverged], tie_factor=TIE_FACTOR)
