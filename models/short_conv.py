"""LFM2's gated short convolution (transformers' ``Lfm2ShortConv``): the mixer of a hybrid model's non-attention
layers, with its state held the way the KV cache is held.

``y = out_proj(C * conv(B * x))`` with ``B, C, x = in_proj(h)`` and a depthwise causal convolution of ``L`` taps over
the sequence. The state is the last ``L - 1`` inputs of the convolution, a fixed-size buffer (``conv_state``,
[1, L - 1, hidden]) with the same name in every exported method, so the methods share it as they share the KV cache.
Unlike a cache it is not indexed by position: a call continues from whatever the previous call left, and a call
at position 0 (a new sequence) starts from zeros, so no method needs a reset of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShortConv(nn.Module):
    """Names follow transformers' (``conv.in_proj``, ``conv.conv``, ``conv.out_proj``), so checkpoints load 1:1."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.kernel = kernel
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel_size=kernel, groups=hidden_size, bias=bias,
                              padding=kernel - 1)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.register_buffer("conv_state", torch.zeros(1, hidden_size, kernel - 1), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` [1, T, hidden] at ``positions`` [T] (in order) -> [1, T, hidden], the state advanced by T inputs."""
        n = self.out_proj.in_features
        bch = self.in_proj(x)  # [1, T, 3 * hidden]: B, C, x; sliced (XNNPACK delegates a slice, not a split)
        b, c, h = (bch[..., i * n:(i + 1) * n].transpose(1, 2) for i in range(3))  # each [1, hidden, T]
        fresh = (positions[:1] > 0).to(h.dtype)  # 0 at position 0: a new sequence forgets the previous one's inputs
        seq = torch.cat([self.conv_state * fresh, b * h], dim=-1)  # [1, hidden, L - 1 + T]
        with torch.no_grad():
            self.conv_state.copy_(seq[:, :, -(self.kernel - 1):])
        # A causal window over the state and the new inputs: exactly T outputs, no padding to cut away.
        y = F.conv1d(seq, self.conv.weight, self.conv.bias, groups=seq.shape[1])
        return self.out_proj((c * y).transpose(1, 2))

    @torch.no_grad()
    def rebuild(self, dtype: torch.dtype, device: str | torch.device) -> None:
        """An empty state in the activations' dtype (after building on the meta device)."""
        self.conv_state = torch.zeros(1, self.conv.weight.shape[0], self.kernel - 1, dtype=dtype, device=device)

    @torch.no_grad()
    def reset(self) -> None:
        self.conv_state.zero_()

    def bytes(self) -> int:
        return self.conv_state.numel() * self.conv_state.element_size()
