"""Casts that add nothing to a captured graph when there is nothing to cast.

``x.to(dtype)`` and ``x.float()`` return ``x`` itself when it already has that dtype, but torch.export still records an
``aten.to.dtype`` and an ``aten._assert_tensor_metadata`` for each: a third of a tiny Gemma 4's decode graph (358 of
1086 nodes), a quarter of a Llama's. They are removed again before the edge program, but capture and the first
decompositions pay for every node. Deciding in Python, where the dtype is known while tracing, keeps them out.
"""

from __future__ import annotations

import torch


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``: ``x`` itself when it has it (no node in a captured graph), else ``x.to(dtype)``."""
    return x if x.dtype == dtype else x.to(dtype)


def fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 (``x.float()`` without a node when it already is)."""
    return cast(x, torch.float32)
