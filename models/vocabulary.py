"""The tokens a restricted lm_head scores: FR-Spec's frequency-ranked vocabulary for a draft model.

A draft proposes tokens for its target to check; what it costs per proposal is mostly its ``lm_head`` when the
vocabulary is large (Qwen2.5-0.5B: 136M of its 494M parameters). FR-Spec (Zhao et al., 2025) keeps the rows of the
most frequent tokens only: a proposal outside them is never made, and the target's check keeps the output exact.

The ranking is the tokenizer's own order unless a text is given: byte-level BPE numbers its tokens in the order it
learnt the merges, the most frequent pair first, and SentencePiece by score; with ``text``, tokens are ranked by
their count in it (as FR-Spec counts a corpus), the order breaking ties. Special tokens (end of text, chat turns) are
always kept: the draft must be able to propose the end of an answer.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import torch

from models.checkpoint import Checkpoint
from models.errors import ModelError
from models.tokenizer import find_tokenizer, load_tokenizer


def frequent_tokens(checkpoint: Checkpoint, size: int, vocab_size: int, text: Path | None = None) -> torch.Tensor:
    """The ``size`` token ids a restricted head scores, ascending: the special ones and the best ranked others."""
    path = find_tokenizer(checkpoint.path)
    if path is None:
        raise ModelError(f"{checkpoint.path} has no tokenizer to rank its vocabulary by.")
    extra = frozenset([*checkpoint.eos_ids, *([checkpoint.bos_id] if checkpoint.bos_id is not None else [])])
    return torch.tensor(_ranked(_stamped(path), extra, size, vocab_size, _stamped(text) if text else None),
                        dtype=torch.int64)


def _stamped(path: Path) -> tuple[str, int, int]:
    """A file as a cache key: its path, size and modification time (an edited file is another key)."""
    stat = path.stat()
    return str(path), stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _ranked(tokenizer: tuple[str, int, int], extra_special: frozenset[int], size: int, vocab_size: int,
            text: tuple[str, int, int] | None) -> tuple[int, ...]:
    """:func:`frequent_tokens`' ids, computed once per process for one tokenizer, size and text (the memory
    estimate's shape-only build and the real one both ask)."""
    tokenizer = load_tokenizer(Path(tokenizer[0]))
    special = {i for i in [*tokenizer.special_ids(), *extra_special] if i < vocab_size}
    if not len(special) < size < vocab_size:
        raise ModelError(f"draft.vocab={size}: the draft's vocabulary has {vocab_size} tokens, {len(special)} of them "
                         f"special (always kept), so draft.vocab must be between {len(special) + 1} and "
                         f"{vocab_size - 1}. Leave it unset to keep every token.")
    counts = Counter(tokenizer.encode(Path(text[0]).read_text(encoding="utf-8"))) if text is not None else Counter()
    ranked = sorted((i for i in range(vocab_size) if i not in special), key=lambda i: (-counts[i], i))
    return tuple(sorted([*special, *ranked[:size - len(special)]]))
