"""Load and run a ``.pte`` (with its ``.ptd`` data file, if it has one) in the ExecuTorch runtime (Python bindings).

XNNPACK's weight cache is on while our tools load methods, as in ExecuTorch's Android and Apple builds: the
methods of a program then share one packed copy of each weight (the pip runtime's default packs one per loaded
method). ``weight_cache=False`` measures the default.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch


def register_runtime_kernels() -> None:
    """Kernels some programs need that the bindings do not load by themselves (quantized embeddings)."""
    with contextlib.suppress(ImportError):
        import executorch.kernels.quantized  # noqa: F401
    with contextlib.suppress(ImportError):
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (llama::custom_sdpa, update_cache)


XNNPACK_BACKEND = "XnnpackBackend"


def use_xnnpack_weight_cache(enabled: bool) -> None:
    """XNNPACK's weight cache for the methods loaded from now on in this process (a runtime option of the
    backend, read when a method is loaded; XNNPACK matches packed weights by their name in the named data store)."""
    from exporters.internals import backend_options, set_backend_options

    if backend_options(XNNPACK_BACKEND, "weight_cache_enabled")["weight_cache_enabled"] != enabled:
        set_backend_options(XNNPACK_BACKEND, weight_cache_enabled=enabled)


class LoadedProgram:
    """A ``.pte`` loaded once; methods are loaded on first use and share the program's mutable buffers.

    ``data_path``: the program's data file; by default the one its manifest lists (checked: present, same
    sha256), else ``<stem>.ptd`` if the program references external weights. ``weight_cache``: load the
    methods with XNNPACK's weight cache (methods share packed weights)."""

    def __init__(self, path: str | Path, data_path: str | Path | None = None, weight_cache: bool = True) -> None:
        from executorch.runtime import Runtime

        from exporters.program.weights import data_file_beside

        register_runtime_kernels()
        self.path = Path(path)
        self.data_path = Path(data_path) if data_path is not None else data_file_beside(self.path)
        self.weight_cache = weight_cache
        self._program = Runtime.get().load_program(str(self.path), data_path=self.data_path)
        self._methods: dict[str, Any] = {}

    @property
    def method_names(self) -> set[str]:
        return set(self._program.method_names)

    def load(self, *methods: str) -> None:
        """Load methods now rather than on their first call."""
        for method in methods:
            if method not in self._methods:
                use_xnnpack_weight_cache(self.weight_cache)
                try:
                    self._methods[method] = self._program.load_method(method)
                except RuntimeError as error:
                    from exporters.program.backends import check_loadable

                    check_loadable(self.path, error)
                    raise

    def run(self, method: str, *inputs: torch.Tensor) -> list[Any]:
        self.load(method)
        return list(self._methods[method].execute(list(inputs)))

    def constant(self, method: str) -> Any:
        """Value of a constant method (a list for list-valued ones such as ``get_eos_ids``)."""
        values = [v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in self.run(method)]
        return values[0] if len(values) == 1 else values


class CapturedPrograms:
    """Runs captured (not yet delegated) programs eagerly, for backends this host cannot execute.

    Each method's ``ExportedProgram.module()`` holds its own copy of the KV-cache buffers, so the cache
    is carried from method to method by hand, as the runtime's shared mutable buffers would.
    """

    def __init__(self, programs: dict[str, Any], cache_buffers: list[str]) -> None:
        self._modules = {name: ep.module() for name, ep in programs.items()}
        self._cache_buffers = cache_buffers
        self._state: dict[str, torch.Tensor] | None = None

    def run(self, method: str, *inputs: torch.Tensor) -> list[Any]:
        module = self._modules[method]
        with torch.no_grad():
            if self._state is None:  # first call: every method starts from an empty cache
                self._state = {n: torch.zeros_like(module.get_buffer(n)) for n in self._cache_buffers}
            for name, value in self._state.items():
                module.get_buffer(name).copy_(value)
            out = module(*inputs)
            self._state = {n: module.get_buffer(n).clone() for n in self._cache_buffers}
        return [out]
