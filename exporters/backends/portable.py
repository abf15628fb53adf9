"""Portable: no delegate; every op runs on ExecuTorch's portable (and optimized, quantized) kernels."""

from __future__ import annotations

from exporters.backends.backend import Backend

BACKEND = Backend(name="portable", partitioner="none", partitioners=lambda options: [], swaps_adapters=True,
                  packed_once="Nothing: the portable kernels read the weights where they are stored, once for all "
                  "methods.")
