"""llm-exporters: Hugging Face LLM checkpoints to validated multi-method ExecuTorch programs.

The package by role (docs/ARCHITECTURE.md):

- commands: ``llm`` (export), ``generate``, ``package``, ``report``; the library call is ``export.export``;
- ``config`` (the schema), ``manifest`` (what an export wrote), ``errors``, ``console``, ``internals``;
- ``stages/``: the pipeline and its stages, load .. bench;
- ``quant/``: quantization schemes and how they are applied;
- ``program/``: methods, layouts, backends, and reading ``.pte`` contents;
- ``runtime/``: running programs (driver, generator, speed, memory, quality);
- ``sweeps/``: sweep jobs, their summary, Optuna's objective, Hydra callbacks and resolvers;
- ``release/``: release bundles.
"""

import importlib.abc
import logging
import sys

# Import-time noise of the pinned stack on a CPU-only host (torchao's CUDA extensions failing to
# load, a torch pytree deprecation): not actionable for users, and it buries the export's own log.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

#: Modules of llm-exporters 0.1 that moved in 0.2 -> where they are now.
MOVED_MODULES = {
    "exporters.artifacts": "exporters.stages.artifacts",
    "exporters.pipeline": "exporters.stages.pipeline",
    "exporters.stages.reference": "exporters.stages.baseline",
    "exporters.quantization": "exporters.quant.schemes (quantize_model: exporters.quant.apply)",
    "exporters.hqq": "exporters.quant.hqq",
    "exporters.methods": "exporters.program.methods",
    "exporters.layouts": "exporters.program.layouts",
    "exporters.backends": "exporters.program.backends",
    "exporters.pte_contents": "exporters.program.contents",
    "exporters.files": "exporters.program.files",
    "exporters.driver": "exporters.runtime.driver",
    "exporters.generator": "exporters.runtime.generator",
    "exporters.benchmark": "exporters.runtime.speed and exporters.runtime.memory",
    "exporters.quality": "exporters.runtime.quality",
    "exporters.job": "exporters.sweeps.job",
    "exporters.search": "exporters.sweeps.search",
    "exporters.callbacks": "exporters.sweeps.callbacks",
    "exporters.bundle": "exporters.release.bundle",
}


class _MovedModules(importlib.abc.MetaPathFinder):
    """``import exporters.quantization`` fails with the module's new place instead of a bare "no module"."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname in MOVED_MODULES:
            raise ModuleNotFoundError(f"{fullname} moved in llm-exporters 0.2: import from "
                                      f"{MOVED_MODULES[fullname]}", name=fullname)
        return None


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
