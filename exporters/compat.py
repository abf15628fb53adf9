"""What earlier releases named differently, in one place, each with the release it goes in.

A user upgrading from 0.1 gets an error naming the new place of a moved module or a renamed config key, and
their manifests still read. Each shim says when it is removed: at that release, delete its block here and the
test that covers it (tests/test_architecture.py, tests/test_config.py, tests/test_run_and_ship.py).
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

# -- Moved modules (0.1 -> 0.2). Goes in 0.4. -----------------------------------------------------------------------

#: Modules of llm-exporters 0.1 that moved in 0.2 -> where they are now.
MOVED_MODULES = {
    "exporters.artifacts": "exporters.context.artifacts",
    "exporters.pipeline": "exporters.stages.pipeline",
    "exporters.stages.reference": "exporters.stages.baseline",
    "exporters.quantization": "exporters.quant.schemes (quantize_model: exporters.quant.apply)",
    "exporters.hqq": "exporters.quant.hqq",
    "exporters.methods": "exporters.program.methods",
    "exporters.layouts": "exporters.program.layouts",
    "exporters.pte_contents": "exporters.program.contents",
    "exporters.files": "exporters.output.files",
    "exporters.driver": "exporters.runtime.driver",
    "exporters.generator": "exporters.runtime.generator",
    "exporters.benchmark": "exporters.runtime.speed and exporters.runtime.memory",
    "exporters.quality": "exporters.runtime.quality",
    "exporters.job": "exporters.sweeps.job",
    "exporters.search": "exporters.sweeps.search",
    "exporters.callbacks": "exporters.sweeps.callbacks",
    "exporters.bundle": "exporters.release.bundle",
}


#: Modules of llm-exporters 0.2.0 that moved when each kind of model became one module (exporters.components) and
#: the top of the package was sorted into folders by role -> where they are now. Goes in 0.5.
MOVED_AFTER_0_2 = {
    "exporters.internals": "exporters.program.internals",
    "exporters.versions": "exporters.program.versions",
    "exporters.footprint": "exporters.plan.footprint",
    "exporters.run_folder": "exporters.output.folder",
    "exporters.interrupts": "exporters.output.interrupts",
    "exporters.plan.lengths": "exporters.program.lengths",
    "exporters.program.files": "exporters.output.files",
    "exporters.program.hybrid": "exporters.components.hybrid",
    "exporters.stages.artifacts": "exporters.context.artifacts",
    "exporters.stages.vision_check": "exporters.validation.image",
    "exporters.sweeps.resolvers": "exporters.config.resolvers",
    "exporters.program.backends": "exporters.backends",
}


class _MovedModules(importlib.abc.MetaPathFinder):
    """``import exporters.quantization`` fails with the module's new place instead of a bare "no module"."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname in MOVED_MODULES:
            raise ModuleNotFoundError(f"{fullname} moved in llm-exporters 0.2: import from "
                                      f"{MOVED_MODULES[fullname]}", name=fullname)
        if fullname in MOVED_AFTER_0_2:
            raise ModuleNotFoundError(f"{fullname} moved after llm-exporters 0.2.0: import from "
                                      f"{MOVED_AFTER_0_2[fullname]}", name=fullname)
        return None


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())


# -- Renamed config keys (0.1 -> 0.2). Goes in 0.4. ------------------------------------------------------------------

#: Keys renamed since 0.1 -> their new name: a config that still uses one is told where it went.
RENAMED_KEYS = {"quant.max_ppl_increase": "quant.max_ppl_drift", "quant.qparams": "quant.algorithm"}


# -- Older manifests. Version 1 (0.1) goes in 0.4; version 2 (0.2, no components) goes in 0.5. ----------------------

def upgrade_manifest(data: dict[str, Any]) -> dict[str, Any]:
    """A manifest as this version writes it, from the JSON of any earlier version."""
    if data.get("version", 1) < 2 and isinstance(data.get("validation"), dict):
        v = dict(data["validation"])
        for old in ("perplexity", "dtype"):
            if f"reference_{old}" in v:
                v[f"baseline_{old}"] = v.pop(f"reference_{old}")
        if v.get("checked", "runtime") != "runtime":  # 0.1 wrote a sentence here
            v["checked"] = "undelegated programs"
        if "max_ppl_increase" in v.get("tolerance", {}):
            v["tolerance"] = {("max_ppl_drift" if k == "max_ppl_increase" else k): x for k, x in v["tolerance"].items()}
        data = {**data, "validation": v}
    if data.get("version", 1) < 3 and "components" not in data and isinstance(data.get("model"), dict):
        # Every program before version 3 held one decoder: its methods are all the program's LLM methods.
        model = data["model"]
        data = {**data, "components": {"decoder": {
            "kind": "decoder", "methods": list(data.get("methods", {})), "adapters": list(data.get("adapters", {})),
            "checkpoint": model.get("checkpoint", ""), "parameters": model.get("parameters"),
            "state": ["kv_cache"] if data.get("kv_cache") else []}}}
    return data
