"""Qwen3.5's Gated DeltaNet (transformers' ``Qwen3_5GatedDeltaNet``): the linear-attention layers of a hybrid model,
with their two states held the way the KV cache is held.

Per call of T tokens: q, k, v from one projection through a causal depthwise convolution (SiLU), per-head gates from
two small projections, then the gated delta rule, a recurrence over a state matrix per value head
(``S <- exp(g) S + k (beta (v - S^T k))^T``, output ``S^T q``), normed per head and gated by a fourth projection.
The states are the convolution's last ``kernel - 1`` inputs ([1, channels, kernel - 1]) and the recurrence's
matrices ([1, value heads, key dim, value dim]): fixed-size buffers named the same in every method, so the methods
share them, zeroed by a call at position 0 (a new sequence).

The recurrence runs in ExecuTorch's ``llama::gated_delta_rule`` kernel, eagerly too (its CPU implementation ships in
the pip wheel), so the program computes what the eager model computes, for a prompt of any length in one call. The
kernel takes fp32: q, k, v, the gates and the state stay fp32 whatever ``quant.dtype`` says, because the state
accumulates every token of the conversation (a rounding per token would compound).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, then times ``silu(gate)`` (transformers' ``Qwen3_5RMSNormGated``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.to(torch.float32))).to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Names follow transformers' (``linear_attn.in_proj_qkv``, ``conv1d``, ``A_log`` ...), so checkpoints load 1:1."""

    def __init__(self, hidden_size: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                 kernel: int, eps: float) -> None:
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers llama::gated_delta_rule)

        super().__init__()
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = key_heads, value_heads, key_dim, value_dim
        self.kernel = kernel
        channels = 2 * key_heads * key_dim + value_heads * value_dim
        self.in_proj_qkv = nn.Linear(hidden_size, channels, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, value_heads * value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, value_heads, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, kernel_size=kernel, groups=channels, bias=False,
                                padding=kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(value_heads))
        self.A_log = nn.Parameter(torch.zeros(value_heads))
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = nn.Linear(value_heads * value_dim, hidden_size, bias=False)
        self.register_buffer("conv_state", torch.zeros(1, channels, kernel - 1), persistent=False)
        self.register_buffer("recurrent_state", torch.zeros(1, value_heads, key_dim, value_dim), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` [1, T, hidden] at ``positions`` [T] (in order) -> [1, T, hidden], both states advanced by T tokens."""
        hk, hv, dk, dv = self.key_heads, self.value_heads, self.key_dim, self.value_dim
        fresh = (positions[:1] > 0).to(torch.float32)  # 0 at position 0: a new sequence starts from empty states
        qkv = self.in_proj_qkv(x).transpose(1, 2)  # [1, channels, T]
        seq = torch.cat([self.conv_state * fresh.to(qkv.dtype), qkv], dim=-1)
        with torch.no_grad():
            self.conv_state.copy_(seq[:, :, -(self.kernel - 1):])
        qkv = F.silu(F.conv1d(seq, self.conv1d.weight, None, groups=seq.shape[1])).transpose(1, 2).float()
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
        rep = hv // hk  # each key head serves `rep` consecutive value heads
        q = l2norm(q.view(1, -1, hk, dk)).repeat_interleave(rep, dim=2) * dk**-0.5
        k = l2norm(k.view(1, -1, hk, dk)).repeat_interleave(rep, dim=2)
        v = v.view(1, -1, hv, dv)
        beta = torch.sigmoid(self.in_proj_b(x).float())  # [1, T, hv]
        decay = torch.exp(-self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float()))
        out, state = torch.ops.llama.gated_delta_rule(
            q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
            decay.transpose(1, 2).contiguous(), beta.transpose(1, 2).contiguous(), self.recurrent_state * fresh)
        with torch.no_grad():
            self.recurrent_state.copy_(state)
        out = out.transpose(1, 2).to(x.dtype)  # [1, T, hv, dv]
        z = self.in_proj_z(x).view(1, -1, hv, dv)
        return self.out_proj(self.norm(out, z).reshape(1, -1, hv * dv))

    @torch.no_grad()
    def rebuild(self, dtype: torch.dtype, device: str | torch.device) -> None:
        """Empty states (after building on the meta device): the convolution's in the activations' dtype, the
        recurrence's in fp32 (the kernel's)."""
        self.conv_state = torch.zeros(1, self.conv1d.weight.shape[0], self.kernel - 1, dtype=dtype, device=device)
        self.recurrent_state = torch.zeros(1, self.value_heads, self.key_dim, self.value_dim, device=device)

    @torch.no_grad()
    def reset(self) -> None:
        self.conv_state.zero_()
        self.recurrent_state.zero_()

    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.conv_state, self.recurrent_state))
