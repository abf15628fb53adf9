"""The typed artifacts passed from stage to stage.

Each artifact keeps what later stages need and drops what they do not (the lowered
``EdgeProgramManager`` is not carried past emit, so its memory can be freed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporters.manifest import Manifest, Signature, ValidationReport
from exporters.program.methods import MethodSpec
from exporters.runtime.quality import TextWindows, perplexity
from exporters.quant.schemes import AppliedQuantization
from models.checkpoint import Checkpoint
from models.decoder import CausalLM


@dataclass
class ReferenceQuality:
    """The validation text in windows, and the unquantized model's negative log-likelihood on it."""

    text: TextWindows
    nll: float
    dtype: str  # the checkpoint's dtype the reference ran in (fp32, or bf16 for a bf16 checkpoint)

    @property
    def perplexity(self) -> float:
        return perplexity(self.nll, self.text.scored_tokens)

    def summary(self) -> str:
        return (f"{self.dtype} perplexity {self.perplexity:.2f} on {self.text.scored_tokens} tokens of "
                f"{self.text.source} ({len(self.text.windows)} windows)")


@dataclass
class LoadedModel:
    model: CausalLM
    checkpoint: Checkpoint
    max_seq_len: int
    reference: ReferenceQuality | None = None  # set by the reference stage when validation is on

    @property
    def family(self) -> str | None:
        from models.families import family_of_config

        found = family_of_config(self.checkpoint.hf_config)
        return found.name if found else None

    def summary(self) -> str:
        if self.reference is not None:
            return self.reference.summary()
        a = self.model.args
        params = sum(p.numel() for p in self.model.parameters())
        return (f"{self.family} family, {params / 1e6:.2f}M parameters, {a.num_hidden_layers} layers, "
                f"hidden {a.hidden_size}, vocab {a.vocab_size}{', tied embeddings' if a.tie_word_embeddings else ''}, "
                f"{a.attention} attention")


@dataclass
class QuantizedModel:
    loaded: LoadedModel
    quantization: AppliedQuantization

    @property
    def model(self) -> CausalLM:
        return self.loaded.model

    def summary(self) -> str:
        return self.quantization.describe()


@dataclass
class CapturedMethods:
    quantized: QuantizedModel
    specs: dict[str, MethodSpec]
    programs: dict[str, Any]  # method name -> torch.export.ExportedProgram
    signatures: dict[str, Signature]
    reference_programs: dict[str, Any] | None = None  # untouched copies, for hosts that cannot run the delegate
    # Methods that compute exactly what another one does (forward and prefill): captured and lowered once,
    # emitted under both names. method name -> the captured method it shares.
    aliases: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        return ", ".join(f"{n}{'(dynamic)' if s.dynamic else ''}{f' = {self.aliases[n]}' if n in self.aliases else ''}"
                         for n, s in self.specs.items())


@dataclass
class LoweredProgram:
    captured: CapturedMethods
    edge: Any  # executorch.exir.EdgeProgramManager over every method; emit drops it once used
    constant_methods: dict[str, Any]
    delegated_partitions: dict[str, int]

    def summary(self) -> str:
        return "delegated partitions per method: " + ", ".join(f"{k}={v}" for k, v in self.delegated_partitions.items())


@dataclass
class EmittedProgram:
    quantized: QuantizedModel
    specs: dict[str, MethodSpec]
    signatures: dict[str, Signature]
    constant_methods: dict[str, Any]
    delegated_partitions: dict[str, int]
    path: Path  # written completely, but under a provisional name until validated
    final_path: Path
    size_bytes: int
    sha256: str
    storage: dict[str, Any]  # bytes by kind: shared weights, other constants, graphs (pte_contents)
    reference_programs: dict[str, Any] | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # method -> the method whose lowered graph it shares

    def summary(self) -> str:
        return f"{self.size_bytes / 1e6:.2f} MB"


@dataclass
class ValidatedProgram:
    emitted: EmittedProgram
    report: ValidationReport | None  # None when validation was switched off

    def summary(self) -> str:
        return self.report.describe() if self.report else "skipped (validate=false)"


@dataclass
class ExportResult:
    """What ``export()`` returns: where the program is and what its manifest says."""

    pte_path: Path
    manifest_path: Path
    manifest: Manifest

    def summary(self) -> str:
        bench = self.manifest.bench
        return bench.describe() if bench else f"{self.pte_path}"
