"""The backends, one module each (``portable``, ``xnnpack``, ``coreml``, ``vulkan``, ``openvino``), registered once.

A backend is its ``conf/backend/<name>.yaml`` (what its kernels support, where it can write weights, whether it runs
here) plus its module here (:class:`~exporters.backends.backend.Backend`: partitioners, its own PT2E quantizers, the
packages it needs beyond the base install, how its device picks a precision). The registries below are read from the
modules; nothing else lists backends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from exporters.backends import coreml, openvino, portable, vulkan, xnnpack
from exporters.backends.backend import Activations, Backend, BackendExtra, Pt2eRecipe
from exporters.config import DType, Pt2eQuantizer
from exporters.errors import UserError, check_choice, listed
from exporters.program.contents import delegate_ids

if TYPE_CHECKING:
    from exporters.config import BackendConfig

__all__ = ["Activations", "BACKENDS", "Backend", "BackendExtra", "EXTRAS", "PT2E_RECIPES", "Pt2eRecipe", "SWAPS_ADAPTERS",
           "check_backend", "check_loadable", "partitioners", "runtime_precision"]

#: Every backend by the partitioner its option file names.
BACKENDS: dict[str, Backend] = {m.BACKEND.partitioner: m.BACKEND for m in (portable, xnnpack, coreml, vulkan, openvino)}
#: The packages each backend needs beyond the base install (checked before an export, and when a program fails to load).
EXTRAS: dict[str, BackendExtra] = {name: b.extra for name, b in BACKENDS.items() if b.extra is not None}
#: Backends whose device picks its own precision, and how to read it on this host.
RUNTIME_PRECISION: dict[str, Callable[[dict[str, Any]], str]] = {
    name: b.precision for name, b in BACKENDS.items() if b.precision is not None}
#: The backends whose programs swap LoRA adapters here (export.adapters=swappable), by option name.
SWAPS_ADAPTERS: tuple[str, ...] = tuple(b.name for b in BACKENDS.values() if b.swaps_adapters)
#: Every backend's own PT2E quantizers (quant=pt2e_<name>).
PT2E_RECIPES: dict[Pt2eQuantizer, Pt2eRecipe] = {q: r for b in BACKENDS.values() for q, r in b.pt2e.items()}


def partitioners(name: str, options: dict[str, Any]) -> list[Any]:
    return BACKENDS[name].partitioners(dict(options))


def runtime_precision(backend: BackendConfig) -> DType | None:
    """The dtype the delegate computes in on this host when the device picks it, else None (the program's)."""
    read = RUNTIME_PRECISION.get(backend.partitioner)
    return DType(read(dict(backend.options))) if read and backend.runs_here else None


def check_loadable(path: Any, error: Exception) -> None:
    """After a method of ``path`` failed to load: if a delegate it uses lacks its packages, say which and how to
    install them (the runtime itself reports only an error code)."""
    used = delegate_ids(path)
    for extra in EXTRAS.values():
        missing = extra.missing() if extra.delegate_id in used else []
        if missing:
            raise UserError(
                f"{path} runs on {extra.delegate_id}, which needs {listed(missing)} in this environment: "
                f"{extra.why}. {extra.install}; ExecuTorch said: {error}") from error


def check_backend(backend: BackendConfig, bench: bool | None) -> None:
    """The option file names a known partitioner, and a bench is asked for only where the delegate runs."""
    check_choice("backend.partitioner", backend.partitioner, sorted(BACKENDS), "Fix the backend option file.")
    if backend.partitioner in EXTRAS:
        EXTRAS[backend.partitioner].check(backend.name)
    if bench and not backend.runs_here:
        raise UserError(
            f"bench=true: backend={backend.name}'s delegate cannot run on this host, so its speed cannot be measured "
            "here. Set bench=false, or run the bench on a device with that backend."
        )
