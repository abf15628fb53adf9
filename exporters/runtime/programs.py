"""Load and run a ``.pte`` (with its ``.ptd`` data file, if it has one) in the ExecuTorch runtime (Python bindings).

XNNPACK's weight cache is on while our tools load methods, as in ExecuTorch's Android and Apple builds: the
methods of a program then share one packed copy of each weight (the pip runtime's default packs one per loaded
method). ``weight_cache=False`` measures the default.
"""

from __future__ import annotations

import contextlib
import tempfile
import weakref
from pathlib import Path
from typing import Any, Sequence

import torch

from exporters.errors import UserError
from exporters.output.files import sha256_of
from exporters.backends import check_loadable
from exporters.program.internals import (backend_options, is_xnnpack_weight_name, merge_data_files,
                                         read_data_file_header, set_backend_options)
from exporters.program.weights import data_files_beside


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

    if backend_options(XNNPACK_BACKEND, "weight_cache_enabled")["weight_cache_enabled"] != enabled:
        set_backend_options(XNNPACK_BACKEND, weight_cache_enabled=enabled)


class PackedWeightNames:
    """Which data file each weight name of the loaded programs comes from, process-wide.

    XNNPACK's weight cache (shared by every program of the process) finds packed weights by their name in the named
    data store. Programs with external weights name them by tensor (exporters.program.weights), so two programs of
    one structure loaded at once with different data files (another checkpoint, a retrained adapter) would share
    the first one's packed weights, silently. ``claim`` refuses that instead."""

    def __init__(self) -> None:
        # name -> (the data file's sha256, its path, the programs using it)
        self._owners: dict[str, tuple[str, Path, set[int]]] = {}

    def claim(self, claimant: object, data_paths: list[Path]) -> None:
        names = {}
        for path in data_paths:
            sha = sha256_of(path)
            for entry in read_data_file_header(path).named_data:
                if not is_xnnpack_weight_name(entry.key):  # the others are read where they are stored, not cached
                    continue
                owner = self._owners.get(entry.key)
                if owner is not None and owner[0] != sha:
                    raise UserError(
                        f"{path} names its weights as {owner[1]} does, which a program loaded in this process "
                        "still uses, and holds other values: XNNPACK's weight cache (shared by the process, on in "
                        "our tools) finds packed weights by name and would run this program with the other's. "
                        "Release the other program first, or load this one with weight_cache=False.")
                names[entry.key] = (sha, path)
        for name, (sha, path) in names.items():
            self._owners.setdefault(name, (sha, path, set()))[2].add(id(claimant))
        weakref.finalize(claimant, self._release, id(claimant))

    def _release(self, claimant_id: int) -> None:
        for name in list(self._owners):
            users = self._owners[name][2]
            users.discard(claimant_id)
            if not users:
                del self._owners[name]


PACKED_WEIGHT_NAMES = PackedWeightNames()


class LoadedProgram:
    """A ``.pte`` loaded once; methods are loaded on first use and share the program's mutable buffers.

    ``data_paths``: the program's data files (the base's weights, then each adapter's); by default the ones its
    manifest lists (checked: present, same sha256), else ``<stem>.ptd`` if the program references external weights
    and the ``<stem>.<adapter>.ptd`` beside it. ExecuTorch 1.5.1's Python runtime takes one data file: several are
    merged into a temporary one (:func:`exporters.program.internals.merge_data_files`), kept while this object lives.
    ``weight_cache``: load the methods with XNNPACK's weight cache (methods share packed weights)."""

    def __init__(self, path: str | Path, data_paths: Sequence[str | Path] | None = None,
                 weight_cache: bool = True) -> None:
        from executorch.runtime import Runtime


        register_runtime_kernels()
        self.path = Path(path)
        self.data_paths = [Path(p) for p in data_paths] if data_paths is not None else data_files_beside(self.path)
        self.weight_cache = weight_cache
        if weight_cache:
            PACKED_WEIGHT_NAMES.claim(self, self.data_paths)
        self._program = Runtime.get().load_program(str(self.path), data_path=self._one_data_file())
        self._methods: dict[str, Any] = {}

    def _one_data_file(self) -> Path | None:
        if len(self.data_paths) < 2:
            return self.data_paths[0] if self.data_paths else None

        self._merged = tempfile.TemporaryDirectory(prefix="merged_data_")
        merged = Path(self._merged.name) / f"{self.path.stem}.ptd"
        merge_data_files(self.data_paths, merged)
        return merged

    @property
    def method_names(self) -> set[str]:
        return set(self._program.method_names)

    @property
    def loaded(self) -> set[str]:
        """The methods loaded so far (a constant method is loaded to read its value; an LLM method packs weights)."""
        return set(self._methods)

    def load(self, *methods: str) -> None:
        """Load methods now rather than on their first call."""
        for method in methods:
            if method not in self._methods:
                use_xnnpack_weight_cache(self.weight_cache)
                try:
                    self._methods[method] = self._program.load_method(method)
                except RuntimeError as error:

                    check_loadable(self.path, error)
                    raise

    def run(self, method: str, *inputs: torch.Tensor) -> list[Any]:
        self.load(method)
        return list(self._methods[method].execute(list(inputs)))

    def positions_per_token(self, method: str) -> bool:
        """Whether ``method`` takes one position per token (Hugging Face's ``cache_position``, as optimum-executorch's
        programs do) rather than the start position alone (ExecuTorch's ``start_pos``, as ours and export_llm's)."""
        meta = self._program.metadata(method)
        return meta.num_inputs() > 1 and int(meta.input_tensor_meta(1).sizes()[0]) > 1

    def inputs_of(self, method: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Each input's shape and dtype, from the program's method metadata, without loading the method."""
        from executorch.exir.scalar_type import ScalarType
        from executorch.exir.tensor import get_scalar_type

        meta = self._program.metadata(method)
        found = []
        for i in range(meta.num_inputs()):
            tensor = meta.input_tensor_meta(i)
            found.append((tuple(int(d) for d in tensor.sizes()), get_scalar_type(ScalarType(int(tensor.dtype())))))
        return found

    def constant(self, method: str) -> Any:
        """Value of a constant method (a list for list-valued ones such as ``get_eos_ids``)."""
        values = [v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in self.run(method)]
        return values[0] if len(values) == 1 else values


def _has_buffer(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_buffer(name)
        return True
    except AttributeError:
        return False


class CapturedPrograms:
    """Runs captured (not yet delegated) programs eagerly, for backends this host cannot execute.

    Each method's ``ExportedProgram.module()`` holds its own copy of the KV-cache buffers, so the cache
    is carried from method to method by hand, as the runtime's shared mutable buffers would.
    """

    def __init__(self, programs: dict[str, Any], cache_buffers: list[str]) -> None:
        self._modules = {name: ep.module() for name, ep in programs.items()}
        # Per method, the cache buffers it holds: a component's methods hold its own (draft.model.layers...).
        self._buffers = {name: [b for b in cache_buffers if _has_buffer(module, b)]
                         for name, module in self._modules.items()}
        self._state: dict[str, torch.Tensor] = {}  # every buffer starts empty, at its first method's first call

    def run(self, method: str, *inputs: torch.Tensor) -> list[Any]:
        module = self._modules[method]
        with torch.no_grad():
            for name in self._buffers[method]:
                if name not in self._state:
                    self._state[name] = torch.zeros_like(module.get_buffer(name))
                module.get_buffer(name).copy_(self._state[name])
            out = module(*inputs)
            self._state.update({n: module.get_buffer(n).clone() for n in self._buffers[method]})
        return [out]
