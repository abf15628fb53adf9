"""Hadamard matrices of the widths LLMs have, and the random orthogonal rotations built from them.

A Hadamard matrix H of order n has entries +-1 and ``H H^T = n I``; ``H / sqrt(n)`` is orthogonal and spreads
any one large coordinate evenly over all n, which is what makes a rotated layer quantize well (QuaRot, SpinQuant).
Orders exist for n = 2^k * m where m has one: Sylvester's doubling gives the powers of two, Paley's two
constructions give q + 1 (q a prime = 3 mod 4) and 2(q + 1) (q a prime = 1 mod 4). That covers the widths of
the models we export (SmolLM2's 576 = 36 * 16, Qwen2.5-0.5B's 896 = 28 * 32 and 4864 = 76 * 64, Qwen2.5-1.5B's
8960 = 140 * 64, Llama's powers of two). torchao's SpinQuant tables (``torchao.prototype.spinquant``) hold a
dozen fixed orders and lack 76; importing them prints a note on stdout, so the orders are built here, and tested.
"""

from __future__ import annotations

from functools import lru_cache

import torch

# Largest power of two an online transform applies as one dense matmul; larger ones are split evenly (exact either
# way: a Kronecker product of Hadamard matrices is one), trading a reshape for fewer multiply-adds.
ONLINE_FACTOR = 64
# Largest factor of any kind an online transform takes: beyond it the transform costs about as much as the layer.
ONLINE_LARGEST = 256


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[i, j] = chi(j - i)``, chi the quadratic character mod the prime ``q`` (0 at 0, +1 on squares, -1 else)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if r in squares else -1.0 for r in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


def _paley(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``m`` by Paley's constructions, or None if neither applies."""
    q = m - 1
    if _is_prime(q) and q % 4 == 3:  # Paley I: H = I + S, S the skew conference matrix [[0, 1], [-1, Q]]
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return torch.eye(m, dtype=torch.float64) + s
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:  # Paley II from the symmetric conference matrix C
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
        plus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        minus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, plus) + torch.kron(torch.eye(q + 1, dtype=torch.float64), minus)
    return None


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def factors(n: int) -> tuple[int, ...] | None:
    """Orders of Hadamard matrices whose Kronecker product has order ``n`` (the odd part's first, then powers of
    two of at most ONLINE_FACTOR), or None when no construction here reaches ``n``."""
    power = n & -n  # the largest power of two dividing n
    odd = n // power
    head: tuple[int, ...] = ()
    if odd > 1:
        m = next((odd * 2 ** j for j in range(2, power.bit_length()) if _paley(odd * 2 ** j) is not None), None)
        if m is None:
            return None
        head, power = (m,), n // m
    bits, most = power.bit_length() - 1, ONLINE_FACTOR.bit_length() - 1
    parts = -(-bits // most)  # as few powers of two as fit under ONLINE_FACTOR, as even as can be
    return head + tuple(2 ** (bits // parts + (i < bits % parts)) for i in range(parts))


@lru_cache(maxsize=None)
def _matrix(order: int) -> torch.Tensor:
    h = _sylvester(order) if order & (order - 1) == 0 else _paley(order)
    assert h is not None, order
    return h


def hadamard_factors(n: int) -> list[torch.Tensor] | None:
    """The +-1 Hadamard matrices of :func:`factors` (float64), or None."""
    orders = factors(n)
    return None if orders is None else [_matrix(k).clone() for k in orders]


def hadamard(n: int) -> torch.Tensor | None:
    """A +-1 Hadamard matrix of order ``n`` (float64), or None when no construction here has one."""
    parts = hadamard_factors(n)
    if parts is None:
        return None
    h = parts[0]
    for part in parts[1:]:
        h = torch.kron(h, part)
    return h


def random_rotation(n: int, seed: int) -> tuple[torch.Tensor, str]:
    """An orthogonal [n, n] float64 matrix and what it is: a Hadamard matrix with random signs on its rows
    (QuaRot's randomized Hadamard), or, for a width no Hadamard construction reaches, the Q of a random Gaussian's
    QR (orthogonal too; it spreads outliers less evenly)."""
    gen = torch.Generator().manual_seed(seed)
    h = hadamard(n)
    if h is None:
        q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))[None, :], f"random orthogonal {n}x{n} (no Hadamard of order {n})"
    signs = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
    return signs[:, None] * h / n ** 0.5, f"randomized Hadamard {n}x{n} ({' x '.join(map(str, factors(n) or ()))})"
