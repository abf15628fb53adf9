"""Log-probabilities of the generated tokens, as OpenAI's two APIs spell them.

They are the program's own: ``log_softmax`` of the logits each token was chosen from, before temperature and top-p
(what OpenAI and vLLM report by default), so a greedy token's log-probability is the largest of its position's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

#: The most alternatives per position each API gives (OpenAI's own limits).
MOST_CHAT, MOST_COMPLETIONS = 20, 5


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the position's most likely tokens, best first


def token_logprob(row: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s entry from the logits ``row`` it was chosen from, with the ``top`` most likely beside it."""
    lp = torch.log_softmax(row.float().reshape(-1), dim=-1)
    best = lp.topk(top) if top else None
    return TokenLogprob(token, float(lp[token]),
                        [] if best is None else list(zip(best.indices.tolist(), best.values.tolist())))


class Recorder:
    """Told each position's logits as generation goes (:meth:`seen`), it reads the token chosen from them in
    ``tokens()`` (the generation's growing list) when the next logits come, and keeps only that entry: one row of
    logits at a time, not every position's (1024 tokens of a 262144-token vocabulary would be 1 GB)."""

    def __init__(self, top: int, tokens: Callable[[], list[int]]) -> None:
        self.top, self.tokens = top, tokens
        self.entries: list[TokenLogprob] = []
        self.pending: torch.Tensor | None = None  # the logits whose token is not chosen yet

    def seen(self, logits: torch.Tensor) -> None:
        self._settle()
        self.pending = logits.detach().clone()

    def _settle(self) -> None:
        chosen = self.tokens()
        if self.pending is not None and len(chosen) > len(self.entries):
            self.entries.append(token_logprob(self.pending, chosen[len(self.entries)], self.top))
        self.pending = None

    def result(self) -> list[TokenLogprob]:
        """One entry per token generated (the logits of a token that ended generation, EOS, are dropped)."""
        self._settle()
        return self.entries


def chat_logprobs(entries: list[TokenLogprob], text_of: Callable[[int], str]) -> dict[str, Any]:
    """``choices[0].logprobs`` of a chat completion."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], text_of: Callable[[int], str]) -> dict[str, Any]:
    """``choices[0].logprobs`` of a text completion (the legacy shape: parallel lists, offsets into the text)."""
    texts = [text_of(e.token) for e in entries]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text_of(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}
