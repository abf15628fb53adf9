"""The typed artifacts passed from stage to stage, and the baseline quality the context carries.

Each artifact is frozen and holds what later stages need: the eager model (validation compares the program
with it), the methods (finalize writes them into the manifest), the undelegated programs (validation runs them
where the runtime cannot execute the delegate). What is no longer needed is not carried: the lowered
``EdgeProgramManager`` ends at emit, the model at finalize.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporters.manifest import DataFile, Manifest, Signature, ppl
from exporters.program.methods import MethodTable
from exporters.runtime.quality import TextWindows, perplexity
from models.decoder import CausalLM
from models.vision_encoder import VisionEncoder


@dataclass(frozen=True)
class BaselineQuality:
    """The validation text in windows, and the unquantized decoder's negative log-likelihood on it (each other
    part's unquantized score is in its own record: exporters.components)."""

    text: TextWindows
    nll: float
    dtype: str  # the checkpoint's dtype it ran in (fp32, or bf16 for a bf16 checkpoint)

    @property
    def perplexity(self) -> float:
        return perplexity(self.nll, self.text.scored_tokens)

    def summary(self) -> str:
        return (f"unquantized {self.dtype} perplexity {ppl(self.perplexity)} on {self.text.scored_tokens} tokens of "
                f"{self.text.source} ({len(self.text.windows)} windows)")


@dataclass(frozen=True)
class EagerModel:
    """The model as PyTorch runs it: after load, unquantized; after quantize, quantized (``quantized=True``)."""

    model: CausalLM
    quantized: bool = False
    # quant.pt2e: the converted graph module every method is captured from; ``model`` then keeps its float
    # linear layers (the graph holds their integer form) and serves for its shape, buffers and tokenizer facts.
    graph: Any = None
    # What the backend computes, as a graph PyTorch steps through many times faster (exporters.quant.pt2e.
    # reference_graph): what validation's undelegated programs are captured from.
    reference_graph: Any = None
    # The program's other components' models (the draft, the vision encoder), by component name, in the same state
    # as ``model``.
    components: dict[str, CausalLM] = field(default_factory=dict)

    def summary(self) -> str:
        return summary(self.model)


def summary(model: CausalLM | VisionEncoder) -> str:
    """A model's size and shape in one line."""
    if isinstance(model, VisionEncoder):
        return model.describe()
    a = model.args
    params = model.parameter_count()
    return (f"{params / 1e6:.2f}M parameters, {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
            f"vocab {a.vocab_size}{', tied embeddings' if a.tie_word_embeddings else ''}, {a.attention} attention")


@dataclass(frozen=True)
class ProgramMethods(MethodTable):
    """The plan's method table, with each method's signature as captured."""

    signatures: dict[str, Signature] = field(default_factory=dict)


@dataclass(frozen=True)
class CapturedMethods:
    model: CausalLM  # quantized eager model
    methods: ProgramMethods
    programs: dict[str, Any]  # method name -> torch.export.ExportedProgram (aliases excluded); lower consumes them
    # Untouched copies for hosts whose runtime cannot execute the delegate (validation runs these instead).
    undelegated: dict[str, Any] | None = None
    components: dict[str, CausalLM] = field(default_factory=dict)  # the other components' quantized eager models

    def summary(self) -> str:
        return self.methods.summary()


@dataclass(frozen=True)
class LoweredProgram:
    model: CausalLM
    methods: ProgramMethods
    edge: Any  # executorch.exir.EdgeProgramManager over every captured method; emit consumes it
    constant_methods: dict[str, Any]
    delegated_partitions: dict[str, int]  # per method, aliases included
    undelegated: dict[str, Any] | None = None
    components: dict[str, CausalLM] = field(default_factory=dict)

    def summary(self) -> str:
        return "delegated partitions per method: " + ", ".join(f"{k}={v}" for k, v in self.delegated_partitions.items())


@dataclass(frozen=True)
class WrittenProgram:
    """The ``.pte`` on disk, complete but under a provisional name until finalize accepts or rejects it."""

    model: CausalLM
    methods: ProgramMethods
    constant_methods: dict[str, Any]
    delegated_partitions: dict[str, int]
    path: Path
    final_path: Path
    size_bytes: int
    sha256: str
    storage: dict[str, int]  # bytes by kind: shared weights, other constants, graphs (exporters.program.contents)
    undelegated: dict[str, Any] | None = None
    data: DataFile | None = None  # export.weights=external: the .ptd beside ``path``, with the same stem
    adapter_data: dict[str, DataFile] = field(default_factory=dict)  # and each adapter's (<stem>.<adapter>.ptd)
    components: dict[str, CausalLM] = field(default_factory=dict)  # the other components' quantized eager models

    @property
    def data_paths(self) -> list[Path]:
        """The data files to load with the program: the base's, then each adapter's."""
        files = ([self.data] if self.data else []) + list(self.adapter_data.values())
        return [self.path.with_name(f.file) for f in files]

    def summary(self) -> str:
        if self.data is None:
            return f"{self.size_bytes / 1e6:.2f} MB"
        adapters = sum(f.size_bytes for f in self.adapter_data.values())
        return (f"{self.size_bytes / 1e6:.2f} MB program + {self.data.size_bytes / 1e6:.2f} MB data file"
                + (f" + {adapters / 1e6:.2f} MB in {len(self.adapter_data)} adapter data file(s)"
                   if self.adapter_data else ""))


@dataclass(frozen=True)
class ExportResult:
    """What ``export()`` returns: where the program is and what its manifest says."""

    pte_path: Path
    manifest_path: Path
    manifest: Manifest

    def summary(self) -> str:
        bench = self.manifest.bench
        return bench.describe() if bench else str(self.pte_path)
