"""Quality on a text: perplexity, and how far a program's next-token distributions are from its eager model.

The validation text is cut into windows that fit the context. In each window the first
``prompt_tokens`` go through the prompt method at once and every later token through the step
method (teacher forcing: the text's own tokens are fed, not the model's), which is how generation
drives a program. Each window predicts its tokens after the prompt; every measure below is over
those predictions, so the program, the eager quantized model and the unquantized baseline are
scored on exactly the same positions.

Why these measures: on real weights a quantized program's logits differ from its eager model by
several units (SmolLM2-135M 8da4w: max |diff| 3.2) while being right, so a max-logit-error gate
rejects good programs. KL divergence of the program's distribution from the eager one and perplexity
measure what a user sees; they grow by orders of magnitude for a broken program (docs/DESIGN.md, README).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from exporters.errors import UserError
from models.checkpoint import Checkpoint
from models.decoder import CausalLM
from models.tokenizer import find_tokenizer, load_tokenizer

if TYPE_CHECKING:
    from exporters.config import ValidationConfig

DEFAULT_TEXT_NAME = "validation_text.txt"
TOP_K = 5
# A text must leave at least this many predicted tokens after the prompt of its first window.
MIN_SCORED_TOKENS = 8


def read_text(text_file: str | None, key: str = "validation.text_file",
              default: str = DEFAULT_TEXT_NAME, fix: str | None = None) -> tuple[str, str]:
    """A text and where it came from: ``text_file`` (the user's, set as ``key``), else ``exporters/data/<default>``.
    ``fix`` says what to do when the file is missing, empty or not UTF-8 (default: give another or the built-in)."""
    if text_file is None:
        return resources.files("exporters").joinpath("data", default).read_text(), f"exporters/data/{default}"
    path = Path(text_file).expanduser()
    fix = fix or (f"Give a UTF-8 text file of a few paragraphs with {key}=<path>, or leave it unset for the built-in "
                  "text.")
    if not path.is_file():
        raise UserError(f"{key}={text_file}: no such file. {fix}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{key}={text_file}: cannot be read as UTF-8 text ({e}). {fix}") from e
    if not text.strip():
        raise UserError(f"{key}={text_file} is empty. {fix}")
    return text, str(path)


def check_validation(cfg: ValidationConfig, enabled: bool) -> None:
    """A given text file is readable (before any work); the settings' own bounds are the schema's
    (exporters.config.ValidationConfig)."""
    if enabled and cfg.text_file is not None:
        read_text(cfg.text_file)


@dataclass
class TextWindows:
    """The validation text as token windows; ``prompt_tokens`` of each go through the prompt method."""

    source: str
    windows: list[torch.Tensor]  # each [1, L], L <= the context length
    prompt_tokens: int

    @property
    def scored_tokens(self) -> int:
        return sum(w.shape[1] - self.prompt_tokens for w in self.windows)

    def targets(self, window: torch.Tensor) -> torch.Tensor:
        """The tokens a window's predictions are scored against: [L - prompt_tokens]."""
        return window[0, self.prompt_tokens:]

    def predictions(self, full_logits: torch.Tensor) -> torch.Tensor:
        """From a whole-window forward's logits [L, V], the rows that predict the targets: [L - P, V]."""
        return full_logits[self.prompt_tokens - 1:-1]

    def nll(self, predictions: list[torch.Tensor], columns: torch.Tensor | None = None) -> float:
        """Negative log-likelihood of every target, given one window's predictions [L - P, V] each (of the targets
        a head scoring ``columns`` scores: :func:`head_targets`)."""
        total = 0.0
        for p, w in zip(predictions, self.windows):
            scored, index = head_targets(self.targets(w), columns)
            total += negative_log_likelihood(p[scored], index[scored])
        return total

    def scored(self, columns: torch.Tensor | None = None) -> int:
        """The targets scored: all (``scored_tokens``), or those a head scoring ``columns`` scores."""
        if columns is None:
            return self.scored_tokens
        return sum(int(head_targets(self.targets(w), columns)[0].sum()) for w in self.windows)


def head_targets(targets: torch.Tensor, columns: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which ``targets`` a head scores, and each as the index of its logit. ``columns``: the token of each logit of a
    head that scores a few (``CausalLM.head_ids``: a draft's FR-Spec vocabulary), None for every token. A target
    outside it has no probability to score: perplexity is over the others, and the share they are is reported."""
    if columns is None:
        return torch.ones_like(targets, dtype=torch.bool), targets
    index = torch.full((max(int(columns.max()), int(targets.max())) + 1,), -1, dtype=torch.int64)
    index[columns] = torch.arange(len(columns))
    found = index[targets]
    return found >= 0, found.clamp(min=0)


def make_windows(ids: list[int], bos_id: int | None, context: int, prompt_tokens: int, max_tokens: int,
                 source: str) -> TextWindows:
    """Windows of at most ``context`` tokens (bos first when the model has one) until ``max_tokens`` are scored."""
    body = context - (bos_id is not None)
    windows: list[torch.Tensor] = []
    scored = 0
    start = 0
    while start < len(ids) and scored < max_tokens:
        chunk = ids[start:start + body]
        start += body
        window = ([bos_id] if bos_id is not None else []) + chunk
        window = window[:prompt_tokens + max_tokens - scored]
        if len(window) < prompt_tokens + MIN_SCORED_TOKENS:
            break  # a short tail scores too little to be worth a window
        windows.append(torch.tensor([window], dtype=torch.int64))
        scored += len(window) - prompt_tokens
    if not windows:
        raise UserError(
            f"the validation text ({source}) is {len(ids)} tokens long; it needs at least "
            f"{prompt_tokens + MIN_SCORED_TOKENS - (bos_id is not None)} ({prompt_tokens} for the prompt and "
            f"{MIN_SCORED_TOKENS} to score). Give a longer text with validation.text_file=<path>, or lower "
            "validation.prompt_tokens."
        )
    return TextWindows(source=source, windows=windows, prompt_tokens=prompt_tokens)


#: Positions scored at a time: the scores are computed in float64 over the whole vocabulary, several [rows, V] tensors
#: at once, so a 128k-token vocabulary over 256 positions at once held about 1.8 GB of temporaries.
SCORED_ROWS = 32


def negative_log_likelihood(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum over positions of -log p(target): logits [N, V], targets [N]."""
    targets = targets.view(-1, 1)
    return sum(float(-torch.log_softmax(logits[i:i + SCORED_ROWS].double(), dim=-1)
                     .gather(-1, targets[i:i + SCORED_ROWS]).sum()) for i in range(0, logits.shape[0], SCORED_ROWS))


def perplexity(nll: float, tokens: int) -> float:
    """exp of the mean negative log-likelihood; infinite past what a float holds (random weights of a large vocabulary
    reach a mean NLL of thousands of nats)."""
    mean = nll / tokens
    return math.exp(mean) if mean < math.log(sys.float_info.max) else math.inf


@dataclass
class Agreement:
    """How the program's predictions [N, V] compare with the eager model's, position by position."""

    kl: torch.Tensor  # [N] KL(eager || program), nats
    top1: torch.Tensor  # [N] bool: same greedy token
    topk_overlap: torch.Tensor  # [N] share of the eager top-k the program also ranks top-k
    max_abs_error: float
    eager_max: float  # max |eager|

    @property
    def max_rel_error(self) -> float:
        """max |program - eager| / max |eager|"""
        return self.max_abs_error / (self.eager_max or 1.0)

    @staticmethod
    def of(eager: torch.Tensor, program: torch.Tensor) -> "Agreement":
        """Row by row, :data:`SCORED_ROWS` at a time (each row's numbers do not depend on the others)."""
        program = program.reshape(eager.shape)
        return Agreement.joined([Agreement._rows(eager[i:i + SCORED_ROWS], program[i:i + SCORED_ROWS])
                                 for i in range(0, eager.shape[0], SCORED_ROWS)])

    @staticmethod
    def _rows(eager: torch.Tensor, program: torch.Tensor) -> "Agreement":
        eager, program = eager.double(), program.double()
        logp_e, logp_p = torch.log_softmax(eager, -1), torch.log_softmax(program, -1)
        kl = (logp_e.exp() * (logp_e - logp_p)).sum(-1).clamp_min(0.0)
        top_e, top_p = eager.topk(TOP_K, -1).indices, program.topk(TOP_K, -1).indices
        overlap = (top_e.unsqueeze(-1) == top_p.unsqueeze(-2)).any(-1).double().mean(-1)
        return Agreement(kl=kl, top1=top_e[:, 0] == top_p[:, 0], topk_overlap=overlap,
                         max_abs_error=float((program - eager).abs().max()), eager_max=float(eager.abs().max()))

    @staticmethod
    def joined(parts: "Sequence[Agreement]") -> "Agreement":
        """The agreement over the positions of ``parts`` together."""
        return Agreement(kl=torch.cat([p.kl for p in parts]), top1=torch.cat([p.top1 for p in parts]),
                         topk_overlap=torch.cat([p.topk_overlap for p in parts]),
                         max_abs_error=max(p.max_abs_error for p in parts), eager_max=max(p.eager_max for p in parts))


def window_logits(model_forward: Callable[[torch.Tensor], torch.Tensor], text: TextWindows) -> list[torch.Tensor]:
    """An eager model's predictions for every window: ``model_forward(window [1, L]) -> logits [L, V]``."""
    with torch.no_grad():
        return [text.predictions(model_forward(w)) for w in text.windows]


def text_ids(ckpt: Checkpoint, vocab_size: int, text: str) -> list[int]:
    """The text as token ids, from the checkpoint's tokenizer; random-init models without one get a fixed
    spread-out id sequence of similar length."""
    tok_file = find_tokenizer(ckpt.path)
    if tok_file is not None:
        return load_tokenizer(tok_file).encode(text)
    return [(7919 * i + 13) % vocab_size for i in range(len(text.split()) * 4 // 3)]


def full_sequence(model: CausalLM):  # type: ignore[no-untyped-def]
    """``window [1, L] -> logits [L, V]`` of an eager model, from an empty cache."""
    def run(window: torch.Tensor) -> torch.Tensor:
        model.reset_cache()
        return model(window, torch.tensor([0]), full_logits=True)[0].float()

    return run
