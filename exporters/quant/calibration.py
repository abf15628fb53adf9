"""The calibration text: read, checked and cut into windows for the calibrated algorithms (``quant.algorithm``).

A shipped English text (``exporters/data/calibration_text.txt``: recipes, letters, explanations, dialogue and
stories, written for this and apart from the validation text) unless ``quant.calibration.text_file`` names the
user's own; its token count and sha256 go into the manifest, so a result can be traced to the text it learned
from. Validation never scores this text, so the quality an export reports is always on text calibration did
not see.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from exporters.config import Algorithm
from exporters.errors import UserError
from exporters.runtime.quality import read_text, text_ids
from models.checkpoint import Checkpoint
from models.decoder import CausalLM

if TYPE_CHECKING:
    from exporters.config import CalibrationConfig, QuantConfig

DEFAULT_CALIBRATION_TEXT = "calibration_text.txt"
# GPTQ estimates each layer's input covariance from the text: with fewer tokens than this, the estimate of a
# 576-1536-wide layer is mostly damping, and calibration does more harm than good.
MIN_CALIBRATION_TOKENS = 512
# Tokens per calibration window: long enough for attention to see real context, short enough that a window's
# activations stay small; never more than the model's KV cache holds.
WINDOW_TOKENS = 512


@dataclass(frozen=True)
class CalibrationText:
    """The calibration text as token windows [1, L], with what the manifest records of it."""

    source: str
    sha256: str
    windows: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return sum(w.shape[1] for w in self.windows)

    def first(self, tokens: int) -> list[torch.Tensor]:
        """The windows cut to the text's first ``tokens`` tokens (measurements that need only a sample)."""
        windows, kept = [], 0
        for w in self.windows:
            if kept >= tokens:
                break
            windows.append(w[:, :tokens - kept])
            kept += windows[-1].shape[1]
        return windows


def _fix(key: str) -> str:
    return (f"Give a longer plain-text file with {key}=<path> (a few thousand words of text like what the model "
            f"will see), or leave it unset for the built-in text.")


def check_calibration(cfg: CalibrationConfig) -> None:
    """Before any work: the text can be read and is not obviously too short (the exact count needs the tokenizer,
    :func:`calibration_text` checks it after loading), and ``max_tokens`` leaves room for enough of it."""
    key = "quant.calibration.text_file"
    if cfg.max_tokens < MIN_CALIBRATION_TOKENS:
        raise UserError(f"quant.calibration.max_tokens={cfg.max_tokens}: calibration needs at least "
                        f"{MIN_CALIBRATION_TOKENS} tokens to estimate each layer's inputs. Raise it (default 4096).")
    text, source = read_text(cfg.text_file, key, DEFAULT_CALIBRATION_TEXT)
    words = len(text.split())
    if words * 2 < MIN_CALIBRATION_TOKENS:  # English runs 1.2-1.5 tokens a word: surely too short
        raise UserError(f"{key}={source} has {words} words; calibration needs at least {MIN_CALIBRATION_TOKENS} "
                        f"tokens. {_fix(key)}")


def calibration_text(cfg: CalibrationConfig, text: str | None, ckpt: Checkpoint, vocab_size: int,
                     context: int) -> CalibrationText:
    """``text`` (else the configured or shipped calibration text) as windows of at most ``context`` tokens, a
    BOS first when the model has one, up to ``cfg.max_tokens`` tokens in all."""
    key = "quant.calibration.text_file"
    source = "the tiny model's training text (models/tiny.py)"
    if text is None:
        text, source = read_text(cfg.text_file, key, DEFAULT_CALIBRATION_TEXT)
    ids = text_ids(ckpt, vocab_size, text)[:cfg.max_tokens]
    if len(ids) < MIN_CALIBRATION_TOKENS:
        raise UserError(f"{key}={source} is {len(ids)} tokens long; calibration needs at least "
                        f"{MIN_CALIBRATION_TOKENS}. {_fix(key)}")
    bos = [ckpt.bos_id] if ckpt.bos_id is not None else []
    body = min(context, WINDOW_TOKENS) - len(bos)
    windows = [torch.tensor([bos + ids[i:i + body]], dtype=torch.int64) for i in range(0, len(ids), body)
               if len(ids[i:i + body]) >= body // 4]  # a short tail adds little but a window's cost
    return CalibrationText(source=source, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(), windows=windows)


def layer_by_layer_blocker(model: CausalLM) -> str | None:
    """Why :class:`LayerByLayer` cannot run this model's layers one at a time, or None."""
    a = model.args
    if any(j is not None for j in a.layer_kv_source):
        return ("its last layers attend over earlier layers' KV caches (Gemma 4's KV sharing), which running one "
                "layer over every window before the next would not hold")
    if a.per_layer_input:
        return "its layers take per-layer embeddings (Gemma 4), which running them one at a time does not compute"
    return None


def check_layer_by_layer(shapes: CausalLM, quant: QuantConfig) -> None:
    """Calibration (GPTQ, signround) and the size budget's sensitivity run the layers one at a time: refused before
    any weight is read where that is not implemented for the model."""
    calibrated = Algorithm(quant.algorithm).torchao_name is None  # what DATA_FREE leaves out (exporters.quant.schemes)
    uses = [f"quant.algorithm={quant.algorithm}"] if calibrated else []
    uses += ["quant.size_budget"] if quant.size_budget is not None else []
    blocker = layer_by_layer_blocker(shapes) if uses else None
    if blocker is not None:
        raise UserError(f"{' and '.join(uses)} run the decoder one layer at a time, which is not implemented for this "
                        f"model: {blocker}. Export it with data-free rounding (quant.algorithm=hqq, the default) "
                        "and without quant.size_budget.")


class LayerByLayer:
    """Token windows run through the decoder one layer at a time, as calibration (each layer solved on the
    outputs of the quantized ones before it) and sensitivity (the model re-run from one layer on) need: every
    window's positions, RoPE and masks computed once. A window longer than one call of the program
    (``args.max_call_tokens``) goes through each layer in calls of that size, as its ring caches need."""

    def __init__(self, model: CausalLM, windows: list[torch.Tensor]) -> None:
        blocker = layer_by_layer_blocker(model)
        if blocker is not None:
            raise UserError(f"this model's layers cannot be run one at a time: {blocker}.")
        self.model = model
        weight = model.lm_head.weight
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        call = model.args.max_call_tokens
        # Per window, per call: the call's positions and every layer's inputs for them.
        self.calls = [[(p, model.layer_inputs(p, dtype)) for p in torch.arange(w.shape[1]).split(call)]
                      for w in windows]
        self.embedded = [model.embed(w) for w in windows]

    def layer(self, i: int, states: list[torch.Tensor],
              after_each: Callable[[], None] | None = None) -> list[torch.Tensor]:
        """Decoder layer ``i`` on every window's hidden states; ``after_each`` is called after each call (a window
        longer than one call makes several, in order)."""
        layer, out = self.model.model.layers[i], []
        for h, calls in zip(states, self.calls):
            pieces = []
            for p, inputs in calls:
                pieces.append(layer(h[:, p[0]:p[-1] + 1], inputs[i].rope, p, inputs[i].mask, inputs[i].slots))
                if after_each is not None:
                    after_each()
            out.append(torch.cat(pieces, dim=1))
        return out

    def window(self, i: int, w: int, h: torch.Tensor) -> torch.Tensor:
        """Decoder layer ``i`` on window ``w``'s hidden states ``h`` alone (learning takes a window a step)."""
        layer = self.model.model.layers[i]
        return torch.cat([layer(h[:, p[0]:p[-1] + 1], inputs[i].rope, p, inputs[i].mask, inputs[i].slots)
                          for p, inputs in self.calls[w]], dim=1)
