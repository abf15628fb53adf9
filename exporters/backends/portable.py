"""Portable: no delegate; every op runs on ExecuTorch's portable (and optimized, quantized) kernels."""

from __future__ import annotations

from exporters.backends.backend import Backend

BACKEND = Backend(partitioner="none", partitioners=lambda options: [])
