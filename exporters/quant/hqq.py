"""torchao's HQQ scale-only weight quantization, computed a block of rows at a time.

``quant.algorithm=hqq`` (the default, as in ExecuTorch's ``export_llm``) runs torchao's
``_choose_qparams_and_quantize_scale_only_hqq``: 20 least-squares refinements of every group's scale, each
a chain of whole-matrix operations. On a large matrix each step of that chain makes a new fp32 copy of it in
DRAM (a 128256 x 2048 embedding: 1 GB each, about four alive at once), so the stage is bound by memory
traffic, not arithmetic (docs/DESIGN.md 2c: the slowest stage at 1B before this). This module runs the same arithmetic
one block of rows at a time, so each step's temporaries stay in cache and only the scales (1/group_size of
the matrix) are whole. Iterations stay outermost and the early stop still looks at every group, so the
result is torchao's, bit for bit (``tests/test_quant_backends.py`` checks it on real weights).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from exporters.program.internals import torchao_hqq_replaced, torchao_hqq_scale_only

# Elements per block: 4 MB of fp32, so a block's temporaries fit in a last-level cache while the Python
# overhead per block (about ten tensor ops) stays small next to the work.
BLOCK_ELEMENTS = 1 << 20


@torch.no_grad()  # as torchao's: a weight Parameter would otherwise record every block's graph
def hqq_scale_only_by_rows(hp_tensor: torch.Tensor, block_size: Sequence[int], qmin: int, qmax: int, *,
                           iters: int = 20, stochastic: bool = False,
                           early_stop_tol: float = 1e-5,
                           block_elements: int = BLOCK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qdata, scale)`` exactly as torchao's ``_choose_qparams_and_quantize_scale_only_hqq`` returns them.

    ``qdata`` is int8 where torchao returns int32 holding the same values (its only caller casts to int8).
    Stochastic rounding draws random numbers in whole-matrix order, so it is left to torchao.
    """
    if stochastic or hp_tensor.ndim != 2 or len(block_size) != 2 or block_size[0] != 1:
        return torchao_hqq_scale_only()(hp_tensor, list(block_size), qmin, qmax, iters=iters,
                                                           stochastic=stochastic, early_stop_tol=early_stop_tol)
    eps = torch.finfo(torch.float32).eps
    rows, width = hp_tensor.shape
    group_size = int(block_size[1])
    assert width % group_size == 0, f"in_features={width} must be divisible by group_size={group_size}"
    weights = hp_tensor.to(torch.float32).contiguous().view(rows, width // group_size, group_size)
    step = max(1, block_elements // width)
    blocks = [slice(start, min(start + step, rows)) for start in range(0, rows, step)]
    qabs = max(abs(qmin), abs(qmax)) or 1

    def rounded(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # [rows, groups, group_size] integer values
        return (w / s.unsqueeze(-1)).round().clamp(qmin, qmax)

    scale = torch.empty(weights.shape[:2], dtype=torch.float32)  # [rows, groups]
    for b in blocks:
        scale[b] = (weights[b].abs().amax(dim=2) / qabs).clamp_min(eps)
    for _ in range(max(1, iters)):
        # Least squares min_s ||W - s * round(W / s)||^2 per group, projected onto s >= eps.
        refined = torch.empty_like(scale)
        for b in blocks:
            w, s = weights[b], scale[b]
            q = rounded(w, s)
            num = (w * q).sum(dim=2, dtype=torch.float32)
            den = (q * q).sum(dim=2, dtype=torch.float32)
            refined[b] = torch.where(den > 0, num / den, s).clamp_min(eps).abs()
        change = ((refined - scale).abs() / scale.clamp_min(eps)).max()
        scale = refined
        if change < early_stop_tol:
            break

    qdata = torch.empty((rows, width), dtype=torch.int8)
    for b in blocks:
        qdata[b] = rounded(weights[b], scale[b]).view(-1, width).to(torch.int8)
    return qdata, scale.to(hp_tensor.dtype)


def hqq_by_rows() -> contextlib.AbstractContextManager[None]:
    """Within this block, torchao's intx weight tensors choose HQQ scales with ``hqq_scale_only_by_rows``."""
    return torchao_hqq_replaced(hqq_scale_only_by_rows)
