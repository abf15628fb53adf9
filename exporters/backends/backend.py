"""What one backend is, as one typed object: its partitioners, its own PT2E quantizers, the packages it needs beyond
the base install, how its device picks a precision. Each backend's module (``exporters.backends.<name>``) fills one."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Literal

from exporters.config import Pt2eQuantizer
from exporters.errors import UserError, listed

#: What a PT2E quantizer does to a linear layer's input: int8 with calibrated scales, int8 per token at run time, or
#: left in float.
Activations = Literal["static", "dynamic", "none"]


@dataclass(frozen=True)
class Pt2eRecipe:
    """One backend quantizer: what it makes of the linear layers, and how to build it."""

    backend: str  # the backend.name whose kernels run what it produces
    activations: Activations
    weight_bits: int  # per output channel, symmetric
    quantizer: Callable[[Activations, int], Any]  # -> the backend's torchao.quantization.pt2e Quantizer
    # Whether the linears' outputs are integer too (XNNPACK's static kernels), or float (delegates that cut
    # the graph at the KV-cache update, whose boundary an integer tensor must not cross).
    quantized_outputs: bool = True

    @property
    def calibrated(self) -> bool:
        """Static activation scales are learned from text; the other quantizers need the weights only."""
        return self.activations == "static"

    def backend_quantizer(self) -> Any:
        """The backend's own quantizer (exporters.quant.pt2e keeps its annotations on the linear layers)."""
        return self.quantizer(self.activations, self.weight_bits)

    def describe(self) -> str:
        acts = {"static": "int8 activations (calibrated scales)", "dynamic": "int8 activations per token at run time",
                "none": "float activations"}[self.activations]
        return f"int{self.weight_bits} per-channel weights, {acts}"


@dataclass(frozen=True)
class BackendExtra:
    """Packages a backend needs beyond the base install: its ``pyproject.toml`` extra and the versions that work."""

    extra: str
    versions: dict[str, str]  # distribution -> the version prefix that works with the pinned ExecuTorch
    delegate_id: str  # the backend id its programs carry (how a program's needs are found at load)
    why: str

    def missing(self) -> list[str]:
        """Each required distribution that is absent or of a version that does not work, with what was found."""
        found = []
        for dist, prefix in self.versions.items():
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                found.append(f"{dist} (not installed)")
                continue
            if not version.startswith(prefix):
                found.append(f"{dist} {version} (needs {prefix}x)")
        return found

    @property
    def install(self) -> str:
        return f"Install the extra: pip install -e \".[{self.extra}]\" (from the checkout)"

    def check(self, backend: str) -> None:
        missing = self.missing()
        if missing:
            raise UserError(f"backend={backend} needs {listed(missing)}: {self.why}. {self.install}. "
                            "Nothing was exported.")


@dataclass(frozen=True)
class Backend:
    """What is true of one backend, beside its ``conf/backend/<name>.yaml`` (what its kernels support)."""

    name: str  # its option file, conf/backend/<name>.yaml (backend=<name>)
    partitioner: str  # what that file names as backend.partitioner
    # backend.options -> the partitioners lowering runs (built lazily: importing a backend's module pulls in none of
    # its dependencies)
    partitioners: Callable[[dict[str, Any]], list[Any]]
    pt2e: dict[Pt2eQuantizer, Pt2eRecipe] = field(default_factory=dict)  # its own PT2E quantizers (quant=pt2e_*)
    extra: BackendExtra | None = None  # packages beyond the base install, checked before an export
    # When its device picks the precision it computes in as a program loads (OpenVINO): how to read it on this host
    # (backend.options -> a DType name); validation then allows that precision's deviation.
    precision: Callable[[dict[str, Any]], str] | None = None
    # Lowering's shortcuts for its partitions through private internals (exporters.program.internals, each with its
    # stock path and a test that both give the same bytes), entered around lowering with export.shortcuts=true.
    lowering_shortcuts: tuple[Callable[[], ContextManager[None]], ...] = ()
    # export.weights=external: a context in which it names the weights it hands to the named data store by tensor
    # (``<namespace>/<module path>``) rather than by content, so the program is the same bytes for any weights;
    # None: it names them so already, or hands none.
    weights_by_name: Callable[[str], ContextManager[None]] | None = None
    # What a runtime needs so that a program's methods share one copy of the weights in memory (the manifest's
    # runtime.packed_once); None: not measured for it.
    packed_once: str | None = None
    # Its programs run here with a set_adapter that swaps LoRA slots, so a swapped adapter can be validated.
    swaps_adapters: bool = False
