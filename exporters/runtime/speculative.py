"""Speculative decoding over a program's ``verify`` method: propose K tokens cheaply, check them in one call.

Each step feeds ``verify`` the last accepted token and K proposals at their positions and gets every position's
logits back; proposals are accepted left to right while the target agrees, and the first disagreement is replaced by
the target's own token (the "bonus" token when all K agree). Rejected tokens are rolled back by position alone:
the next call writes over their cache slots, and no query attends past its own position.

The output is exactly the target's: greedily, token for token what plain greedy decoding gives; with sampling, the
standard accept/reject rule (a deterministic proposal ``d`` is kept with probability ``p(d)``, else a token is drawn
from ``p`` without ``d``), so every token is distributed as the target's.

Proposers: ``lookup`` (prompt-lookup decoding: the tokens that followed the latest earlier occurrence of the text's
last n-gram) needs no second model; ``draft`` runs the program's draft model (``draft_prefill``,
``draft_decode_one_token``) greedily, K tokens ahead, or Gemma 4's assistant (one call, K tokens, from the
target's own state). All propose deterministically, so the rule above is exact for each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal, Protocol

import torch

from exporters.errors import UserError
from exporters.runtime.sampling import SamplingConfig, distribution, sample

if TYPE_CHECKING:
    from exporters.runtime.constraint import Constraint
    from exporters.runtime.driver import Driver, RunsMethods

Speculative = Literal["auto", "draft", "lookup", "none"]
SPECULATIVE: tuple[str, ...] = ("auto", "draft", "lookup", "none")
StopReason = Literal["eos", "max_new_tokens", "context_full"]


@dataclass
class SpeculationStats:
    """What speculation did in one generation: proposals checked and kept, and calls of the target."""

    steps: int = 0  # verify calls
    proposed: int = 0  # proposals checked (K per verify call)
    accepted: int = 0  # proposals kept
    target_calls: int = 0  # verify and one-token calls of the target after the prompt
    tokens: int = 0  # tokens generated

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_call(self) -> float:
        return self.tokens / self.target_calls if self.target_calls else 0.0

    def describe(self) -> str:
        return (f"speculative: {self.accepted}/{self.proposed} proposals accepted ({self.acceptance:.0%}), "
                f"{self.tokens_per_call:.2f} tokens per target call")


def lookup_proposals(ids: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens of ``ids`` (n from
    ``max_ngram`` down to 1); none if no suffix occurred before."""
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                follow = ids[start + n:start + n + k]
                if follow:
                    return follow
    return []


class Proposer(Protocol):
    """Guesses the next tokens of a text; the target's verify method checks them."""

    name: str

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``ids`` (the whole text so far), or none."""
        ...


class LookupProposer:
    """Prompt-lookup decoding: no model, the text's own n-grams."""

    name = "lookup"

    def propose(self, ids: list[int], k: int) -> list[int]:
        return lookup_proposals(ids, k)


class DraftProposer:
    """The program's draft model, greedily: it catches up on the text its cache has not seen, then proposes one token
    per ``draft_decode_one_token`` call. Its cache is rolled back by position, as the target's: what it holds beyond
    the text's common prefix with what it was fed is overwritten.

    After a verify call the draft has not seen one or two tokens (the target's correction, or the last proposal and
    the bonus token): those go through the one-token method, which costs less than a prompt call of two tokens
    (Qwen2.5-Coder-0.5B 8da4w on 2 cores: 11 ms a token against 28 ms for two through ``draft_prefill``); a longer
    text (the prompt) goes through ``draft_prefill``."""

    name = "draft"
    ONE_BY_ONE = 2  # at most this many unseen tokens go through the one-token method

    def __init__(self, driver: Driver, vocab: torch.Tensor | None = None) -> None:
        """``vocab``: the token of each of the draft's logits when it scores a few (``get_draft_vocab``)."""
        self.driver = driver
        self.vocab = vocab.tolist() if vocab is not None else None
        self.fed: list[int] = []  # the tokens its cache holds, position by position

    def _best(self, logits: torch.Tensor) -> int:
        best = int(logits.argmax())
        return self.vocab[best] if self.vocab is not None else best

    def propose(self, ids: list[int], k: int) -> list[int]:
        same = next((i for i, (a, b) in enumerate(zip(self.fed, ids)) if a != b), min(len(self.fed), len(ids)))
        start = min(same, len(ids) - 1)  # at least the last token is fed: its logits give the first proposal
        if len(ids) - start <= self.ONE_BY_ONE:
            for position in range(start, len(ids)):
                logits = self.driver.decode_one_token(ids[position], position)
        else:
            logits = self.driver.prefill(torch.tensor([ids[start:]], dtype=torch.int64), start)
        proposals = [self._best(logits)]
        for j in range(k - 1):
            proposals.append(self._best(self.driver.decode_one_token(proposals[-1], len(ids) + j)))
        self.fed = ids + proposals[:-1]
        return proposals


class AssistantProposer:
    """Gemma 4's assistant in the program (``models.gemma4_drafter``): one call of its method proposes up to K tokens
    from the last token and its position alone. It keeps no state of its own (it reads the target's caches and final
    hidden states, rolled back by position as the target's are), so nothing is fed to catch up."""

    name = "draft"

    def __init__(self, program: RunsMethods, method: str) -> None:
        self.program, self.method = program, method

    def propose(self, ids: list[int], k: int) -> list[int]:
        found = self.program.run(self.method, torch.tensor([ids[-1:]], dtype=torch.int64),
                                 torch.tensor([len(ids) - 1]))[0]
        return [int(t) for t in found.reshape(-1)[:k]]


@dataclass
class DraftLength:
    """How many tokens to propose per verify call, at most ``most`` (the program's ``get_draft_tokens``): ``tokens``
    always, or (None) adapted as transformers' assisted generation does (its "heuristic" schedule): two more after a
    call that kept every proposal, one fewer after one that did not. Long runs of accepted tokens (an edit copying
    its input) then go through few calls, and a text the proposer cannot guess costs little."""

    most: int
    tokens: int | None = None

    def __post_init__(self) -> None:
        self.check(self.most, self.tokens)
        self.current = self.tokens if self.tokens is not None else self.most

    @staticmethod
    def check(most: int, tokens: int | None) -> None:
        """``tokens`` proposals per call fit a verify that checks at most ``most`` (None: adapted, always fits)."""
        if tokens is not None and not 1 <= tokens <= most:
            raise UserError(f"draft_tokens={tokens}: the program's verify checks 1 to {most} proposals per "
                            f"call (get_draft_tokens). Give a number in that range, or leave it unset to adapt.")

    def update(self, proposed: int, kept: int) -> None:
        if self.tokens is None:
            self.current = min(self.most, self.current + 2) if kept == proposed else max(1, self.current - 1)


@dataclass
class Acceptance:
    """The accept/reject rule for one verify call: which proposals are kept and the token after them."""

    kept: list[int] = field(default_factory=list)
    next_token: int = -1


def accept(logits: torch.Tensor, proposals: list[int], choose: Callable[[torch.Tensor], torch.Tensor],
           generator: torch.Generator, greedy: bool) -> Acceptance:
    """``logits`` [K+1, V]: row i follows the i-th token fed (the last accepted one, then the proposals).
    ``choose(row)`` gives the target's distribution (after temperature and top-p) of one row."""
    result = Acceptance()
    for i, proposal in enumerate(proposals):
        row = logits[i]
        if greedy:
            target = int(row.argmax())
            if target != proposal:
                result.next_token = target
                return result
        else:
            p = choose(row)
            if float(torch.rand((), generator=generator)) >= float(p[proposal]):
                rest = p.clone()
                rest[proposal] = 0.0
                if float(rest.sum()) <= 0:  # p was all on the proposal: it cannot be rejected (kept above)
                    rest = p
                result.next_token = int(torch.multinomial(rest / rest.sum(), 1, generator=generator))
                return result
        result.kept.append(proposal)
    last = logits[len(proposals)]
    result.next_token = int(last.argmax()) if greedy else int(torch.multinomial(choose(last), 1, generator=generator))
    return result


def pad_with_last(tokens: list[int], n: int) -> list[int]:
    """``tokens`` (at least one, at most ``n``) with the last repeated up to ``n``: what a verify of fixed size takes
    (the repeats are checked and thrown away)."""
    return (tokens + tokens[-1:] * n)[:n]


@dataclass(frozen=True)
class Stops:
    """When generation ends besides ``max_new_tokens``: an end-of-sequence token, or a full cache (unless endless)."""

    eos_ids: set[int]
    max_context_len: int
    endless: bool = False  # a ring cache with a sink: generation goes on past the cache


@dataclass(frozen=True)
class Speculation:
    """Proposals checked by ``verify``: who proposes, and how many each call (None: as many as pay, DraftLength)."""

    proposer: Proposer
    draft_tokens: int | None = None


@dataclass(frozen=True)
class Observers:
    """Told as generation goes: ``emit`` each token as it is decided; ``seen`` the logits each token was chosen from,
    without speculation (validation reads how close the top two were)."""

    emit: Callable[[int], None] = lambda token: None
    seen: Callable[[torch.Tensor], None] | None = None


def continue_text(driver: Driver, ids: list[int], logits: torch.Tensor, cfg: SamplingConfig, stops: Stops,
                  speculation: Speculation | None = None, observers: Observers = Observers(),
                  constraint: Constraint | None = None) -> tuple[list[int], StopReason, SpeculationStats | None]:
    """Generate after the prompt ``ids`` whose last logits are ``logits``: one token per call of the step method, or
    with ``speculation`` several per call of ``verify``. The new tokens, why generation stopped, and speculation's
    numbers. ``constraint``: each token chosen among those its grammar allows (without speculation), generation
    ending when the document is complete."""
    assert constraint is None or speculation is None, "a constraint chooses one token per call"
    eos_ids, max_context_len, endless = stops.eos_ids, stops.max_context_len, stops.endless
    proposer = speculation.proposer if speculation is not None else None
    draft_tokens = speculation.draft_tokens if speculation is not None else None
    emit, seen = observers.emit, observers.seen
    gen = torch.Generator().manual_seed(cfg.seed)
    new_ids: list[int] = []
    stop: StopReason = "max_new_tokens"
    stats = SpeculationStats() if proposer is not None else None
    most = driver.roles.verify_tokens - 1
    padded = driver.roles.verify_min_tokens - 1  # a static verify takes exactly this many proposals
    # A static verify costs the same however many proposals are real: unless told, propose as many as it takes.
    if draft_tokens is None and padded == most:
        draft_tokens = most
    length = DraftLength(most, draft_tokens) if proposer is not None else None
    def choose(logits: torch.Tensor) -> int:
        if seen:
            seen(logits)
        return sample(logits if constraint is None else constraint.allow(logits), cfg, gen)

    pending = [choose(logits)]  # tokens chosen, not yet emitted
    while pending and len(new_ids) < cfg.max_new_tokens:
        token = pending.pop(0)
        if token in eos_ids:
            stop = "eos"
            break
        new_ids.append(token)
        emit(token)
        if constraint is not None:
            constraint.consume(token)
            if constraint.complete:  # nothing may follow: the end of text the grammar would force, without a call
                stop = "eos"
                break
        position = len(ids) + len(new_ids) - 1
        if position + 1 >= max_context_len and not endless:
            stop = "context_full"
            break
        if pending:  # accepted proposals, already checked: emitted without another call
            continue
        k = length.current if length is not None else 0
        room = endless or position + max(k, padded) < max_context_len
        proposals = proposer.propose(ids + new_ids, k) if proposer is not None and room else []
        if stats is not None and length is not None and proposals:
            proposals = pad_with_last(proposals, max(len(proposals), padded))
            checked = accept(driver.verify([token, *proposals], position), proposals,
                             lambda row: distribution(row, cfg), gen, greedy=cfg.temperature <= 0)
            length.update(len(proposals), len(checked.kept))
            stats.steps, stats.proposed, stats.accepted = stats.steps + 1, stats.proposed + len(proposals), \
                stats.accepted + len(checked.kept)
            stats.target_calls += 1
            pending = [*checked.kept, checked.next_token]
            continue
        logits = driver.decode_one_token(token, position)
        if stats is not None:
            stats.target_calls += 1
        pending = [choose(logits)]
    if stats is not None:
        stats.tokens = len(new_ids)
    return new_ids, stop, stats
