"""llm-exporters: Hugging Face LLM checkpoints to validated multi-method ExecuTorch programs.

The package by role (docs/ARCHITECTURE.md):

- commands: ``llm`` (export), ``generate``, ``package``, ``report``; the library call is ``export.export``;
- ``config`` (the schema), ``plan/`` (every decision of an export, resolved once), ``manifest`` (what an
  export wrote), ``errors``, ``console``, ``internals`` and ``versions`` (private internals and the versions they
  were checked with), ``compat`` (what older releases named differently);
- ``stages/``: the pipeline and its stages, load .. bench;
- ``quant/``: quantization schemes and how they are applied;
- ``program/``: methods, layouts, backends, and reading ``.pte`` contents;
- ``runtime/``: running programs (driver, generator, speed, memory, quality);
- ``sweeps/``: sweep jobs, their summary, Optuna's objective, Hydra callbacks and resolvers;
- ``release/``: release bundles.
"""

import logging

# Import-time noise of the pinned stack on a CPU-only host (torchao's CUDA extensions failing to
# load, a torch pytree deprecation): not actionable for users, and it buries the export's own log.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

from exporters import compat  # noqa: E402,F401  (installs the finder that names moved modules)
