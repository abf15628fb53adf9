"""Dynamic dimensions kept whole through lowering.

ExecuTorch's ``to_edge`` and ``to_executorch`` trace each method again on fake tensors with the example's sizes as
hints. torch's fake convolution (``torch/_subclasses/fake_impls.py``, ``conv``) then asks
``torch._C._select_conv_backend`` which kernel it would run, and oneDNN's choice depends on the input's size: that
adds a guard on the dynamic dimension and silently narrows its range to the example's side of it (Gemma 4's audio
tower: 4..3000 frames became 8..112, so memory planning sized ``audio_encoder`` for 1.1 s of audio and the runtime
refused longer recordings). With oneDNN off while tracing, the fake convolution picks no size-dependent backend and
the range stays what ``torch.export`` was given; the program runs XNNPACK's or the portable kernels either way.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def convolutions_unguarded() -> Iterator[None]:
    """Within this block, tracing a convolution adds no guard on a dynamic dimension (module docstring)."""
    with torch.backends.mkldnn.flags(enabled=False):
        yield
