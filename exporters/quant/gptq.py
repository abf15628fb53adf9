"""GPTQ: integer weights chosen with the layer's inputs in view, in exactly the form XNNPACK's kernels store.

Round-to-nearest (HQQ or min/max scales) rounds every weight on its own. GPTQ (Frantar et al., 2022) rounds
one input column at a time and moves each column's rounding error onto the columns not yet rounded, in the
proportions that leave the layer's output on the calibration inputs least changed: the inverse of the
inputs' second-moment matrix ``H = sum x x^T`` (the Hessian of the squared output error) says how.

The result is a plain symmetric code and scale per group, as XNNPACK runs them (docs/DESIGN.md section 7):
codes in ``[qmin, qmax]`` with no zero point, and group scales rounded to bf16 before any code is chosen,
because XNNPACK stores blockwise scales as bf16 (``backends/xnnpack/operators/node_visitor.py``,
``get_quant_params``). Each group's scale is the one of a few candidates that minimizes the activation-weighted
rounding error of that group (the diagonal of ``H`` weighs each input); for one scale per row (8-bit) it is
chosen from the whole row before the first column is rounded, as the GPTQ paper does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Columns whose errors are carried together before the rest of the matrix is updated (the paper's "lazy
# batch"): a multiple of the group size, so a group's scale is chosen from columns already compensated.
BLOCK_COLUMNS = 128
# Damping added to H's diagonal, as a share of its mean: keeps the Cholesky factorization stable when the
# calibration text leaves some input directions unexcited (the paper's 1%).
DAMPING = 0.01
# Scale candidates: the group's max |w| mapped to qmax + 0.5, shrunk by these factors. Shrinking clips the
# largest weight a little in exchange for a finer step for all the others.
SHRINK = tuple(1.0 - 0.025 * k for k in range(13))


@dataclass(frozen=True)
class IntGrid:
    """The integer format of one layer: codes in ``[qmin, qmax]``, one scale per ``group_size`` inputs
    (0: one per row), scales rounded to bf16 (XNNPACK's blockwise kernels) or kept in fp32 (per-row)."""

    qmin: int
    qmax: int
    group_size: int

    @property
    def bf16_scales(self) -> bool:
        return self.group_size != 0

    def round_scale(self, scale: torch.Tensor) -> torch.Tensor:
        scale = scale.clamp_min(torch.finfo(torch.bfloat16).tiny if self.bf16_scales else 1e-12)
        return scale.to(torch.bfloat16).float() if self.bf16_scales else scale

    def codes(self, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.clamp(torch.round(w / scale), self.qmin, self.qmax, out=out)


def best_scales(w: torch.Tensor, importance: torch.Tensor, grid: IntGrid) -> torch.Tensor:
    """Per row and group of ``w`` [rows, groups, group] the candidate scale with the least rounding error, each
    input's squared error weighed by ``importance`` [groups, group] (its activations' energy); returns
    [rows, groups, 1], already rounded. Every group at once: one pass over the candidates, not one per group."""
    peak = w.abs().amax(dim=-1, keepdim=True) / (grid.qmax + 0.5)
    best, best_err = None, None
    for shrink in SHRINK:
        scale = grid.round_scale(peak * shrink)
        err = ((w - grid.codes(w, scale) * scale) ** 2 * importance).sum(dim=-1, keepdim=True)
        if best is None:
            best, best_err = scale, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, scale, best), torch.where(better, err, best_err)
    assert best is not None
    return best


def shrunk(hessian: torch.Tensor, tokens: int) -> torch.Tensor:
    """``hessian`` pulled toward its diagonal by ``cols / (cols + tokens)``.

    A few thousand calibration tokens estimate the correlations between 1536 inputs (an MLP's down projection)
    poorly, and GPTQ then fits the calibration text and loses on other text: measured on SmolLM2-135M's layer 5
    with 2048 calibration tokens, down_proj's output error on unseen text was 0.0105 plain against HQQ's 0.0069,
    and 0.0058 shrunk this way (q_proj, 576 inputs: 0.0016 and 0.0015 against HQQ's 0.0049). The diagonal (each
    input's own energy) is estimated well, so it is kept; the more inputs per token, the less the rest is trusted.
    """
    cols = hessian.shape[0]
    weight = cols / (cols + tokens)
    return (1 - weight) * hessian + weight * torch.diag(hessian.diagonal())


def inverse_hessian_factor(hessian: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of ``H^-1`` (damped), which GPTQ's column updates read row by row."""
    h = hessian.double()
    damp = DAMPING * h.diagonal().mean().clamp_min(1e-12)
    for attempt in range(6):  # a nearly singular H (tiny calibration, dead inputs) gets more damping
        try:
            lower = torch.linalg.cholesky(h + damp * (10 ** attempt) * torch.eye(len(h), dtype=h.dtype))
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True).float()
        except torch.linalg.LinAlgError:
            continue
    raise RuntimeError("GPTQ: the calibration inputs' Hessian could not be factorized even with 10^5x damping")


# Rows whose groups' scales are chosen at once: bounds the temporaries (a few copies of [rows, cols]) to a few MB
# whatever the matrix (an 8B lm_head is 128256 rows).
SCALE_ROWS = 4096


def static_scales(w: torch.Tensor, importance: torch.Tensor, grid: IntGrid) -> torch.Tensor:
    """Every group's scale [rows, groups], chosen from the weights before any error is compensated."""
    rows, cols = w.shape
    group = grid.group_size or cols
    weights = importance.reshape(cols // group, group)
    return torch.cat([best_scales(chunk.reshape(-1, cols // group, group), weights, grid)[..., 0]
                      for chunk in w.split(SCALE_ROWS)])


@torch.no_grad()
def gptq(weight: torch.Tensor, hessian: torch.Tensor, tokens: int, grid: IntGrid,
         act_order: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 [rows, cols], scales fp32 [rows, groups])`` for ``weight`` [rows, cols], given the
    calibration inputs' ``hessian`` [cols, cols] (``sum x x^T`` over ``tokens`` inputs); ``codes * scales`` (per group) is what the
    kernels compute with.

    With ``act_order`` the columns are rounded in order of decreasing input energy (the paper's "act-order"), so
    the inputs that matter most are rounded while the most columns remain to absorb their error; each group's
    scale is then fixed before the first column is rounded ("static groups"), since a group's columns are no
    longer rounded together.
    """
    w = weight.detach().float().clone()
    rows, cols = w.shape
    group = grid.group_size or cols
    assert cols % group == 0, f"group size {group} does not divide {cols} inputs"
    h = shrunk(hessian.float(), tokens)
    dead = h.diagonal() == 0  # inputs the calibration text never excited: nothing to compensate with
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    importance = h.diagonal().clone()
    scales = static_scales(w, importance, grid)
    order = torch.argsort(importance, descending=True) if act_order else torch.arange(cols)
    w, h = w[:, order], h[order][:, order]
    u = inverse_hessian_factor(h)
    del h

    codes = torch.empty((rows, cols), dtype=torch.int8)
    column_scale = scales.T[order // group]  # [cols, rows], one allocation: each (permuted) column's group scale
    for start in range(0, cols, BLOCK_COLUMNS):
        end = min(start + BLOCK_COLUMNS, cols)
        # Columns as rows ([cols, rows], contiguous): each step below reads and writes whole rows.
        w_block = w[:, start:end].T.contiguous()
        u_block = u[start:end, start:end]
        diagonal = u_block.diagonal().tolist()
        q_block, update = torch.empty_like(w_block), torch.empty_like(w_block)  # no allocation per column
        for i in range(end - start):
            column, scale = w_block[i], column_scale[start + i]
            q = grid.codes(column, scale, out=q_block[i])
            err = (column - q * scale) / diagonal[i]
            torch.mul(u_block[i, i:, None], err, out=update[i:])
            w_block[i:] -= update[i:]
            w_block[i] = err  # the column is rounded: its row now holds its error, for the update below
        codes[:, order[start:end]] = q_block.T.to(torch.int8)
        w[:, end:] -= w_block.T.contiguous() @ u[start:end, end:]  # [rows, block] as the errors were stored before
    return codes, scales
