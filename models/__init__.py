"""Checkpoints, the exportable decoder and its caches, model families, tokenizers, LoRA adapters."""

import logging

# Import-time noise of the pinned stack on a CPU-only host (torchao's CUDA extensions failing to load, a torch pytree
# deprecation): not actionable, and printed by any process that imports them first (the tests' helper commands,
# benchmarks); exporters/__init__.py quiets them the same way.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
