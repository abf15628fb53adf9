"""The token counts of an export, each with one meaning everywhere (code, manifest, constant methods)."""

from __future__ import annotations

from dataclasses import dataclass

from exporters.config import ExportConfig


@dataclass(frozen=True)
class Lengths:
    """Token counts, each with one meaning everywhere (code, manifest, constant methods)."""

    context: int  # KV-cache positions: the longest conversation (get_max_context_len)
    max_seq_len: int  # what the stock runner reads as one call's size (get_max_seq_len, export.max_seq_len)
    call_tokens: int  # most tokens one call of a prompt method takes: max_seq_len, below the cache length
    prefill_chunk: int | None  # static-shape backends: the prompt methods' fixed token count; None: dynamic
    verify_tokens: int  # the verify method's tokens: the last accepted one and draft.tokens proposals

    @staticmethod
    def of(max_seq_len: int, max_context_len: int | None, dynamic: bool, prefill_chunk: int,
           draft_tokens: int) -> "Lengths":
        context = max_context_len if max_context_len is not None else max_seq_len
        # A prompt leaves room for one generated token: the stock runner requires prompt < get_max_context_len
        # and feeds longer prompts in calls of get_max_seq_len tokens.
        return Lengths(context, max_seq_len, min(max_seq_len, context - 1), None if dynamic else prefill_chunk,
                       draft_tokens + 1)

    @staticmethod
    def of_config(cfg: ExportConfig) -> "Lengths":
        ex = cfg.export
        return Lengths.of(ex.max_seq_len, ex.max_context_len, cfg.backend.dynamic_shapes, ex.prefill_chunk,
                          cfg.draft.tokens)
