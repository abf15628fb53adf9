"""The typed artifacts passed from stage to stage.

Each artifact keeps what later stages need and drops what they do not (the lowered
``EdgeProgramManager`` is not carried past emit, so its memory can be freed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporters.methods import MethodSpec
from exporters.quantization import AppliedQuantization
from models.checkpoint import Checkpoint
from models.decoder import CausalLM


@dataclass
class LoadedModel:
    model: CausalLM
    checkpoint: Checkpoint
    max_seq_len: int

    @property
    def family(self) -> str | None:
        from models.families import family_of_config

        found = family_of_config(self.checkpoint.hf_config)
        return found.name if found else None

    def summary(self) -> str:
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
    signatures: dict[str, dict[str, Any]]
    reference_programs: dict[str, Any] | None = None  # untouched copies, for hosts that cannot run the delegate

    def summary(self) -> str:
        return ", ".join(f"{n}{'(dynamic)' if s.dynamic else ''}" for n, s in self.specs.items())


@dataclass
class LoweredProgram:
    captured: CapturedMethods
    edge: Any  # executorch.exir.EdgeProgramManager over every method
    constant_methods: dict[str, Any]
    delegated_partitions: dict[str, int]

    def summary(self) -> str:
        return "delegated partitions per method: " + ", ".join(f"{k}={v}" for k, v in self.delegated_partitions.items())


@dataclass
class EmittedProgram:
    quantized: QuantizedModel
    specs: dict[str, MethodSpec]
    signatures: dict[str, dict[str, Any]]
    constant_methods: dict[str, Any]
    delegated_partitions: dict[str, int]
    path: Path  # written completely, but under a provisional name until validated
    final_path: Path
    size_bytes: int
    sha256: str
    storage: dict[str, Any]  # bytes by kind: shared weights, other constants, graphs (pte_contents)
    reference_programs: dict[str, Any] | None = None

    def summary(self) -> str:
        return f"{self.size_bytes / 1e6:.2f} MB"


@dataclass
class ValidationReport:
    passed: bool
    prompt_tokens: int
    decode_steps: int
    max_abs_error: float
    max_rel_error: float
    token_agreement: float  # greedy tokens equal, or a near-tie within the error tolerance
    exact_token_agreement: float
    per_step: list[dict[str, Any]] = field(default_factory=list)
    tolerance: dict[str, float] = field(default_factory=dict)
    # What was compared with the eager model: the .pte in the ExecuTorch runtime, or (for a delegate
    # this host cannot run) the captured programs before delegation.
    checked: str = "runtime"

    def describe(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        where = "" if self.checked == "runtime" else " [captured programs only: the delegate cannot run on this host]"
        return (f"{verdict}{where}: prompt {self.prompt_tokens} tokens + {self.decode_steps} decode steps, "
                f"max abs err {self.max_abs_error:.3g}, max rel err {self.max_rel_error:.3g} "
                f"(limit {self.tolerance.get('max_rel_error')}), greedy agreement {self.token_agreement:.0%} "
                f"({self.exact_token_agreement:.0%} exact)")


@dataclass
class ValidatedProgram:
    emitted: EmittedProgram
    report: ValidationReport | None  # None when validation was switched off

    def summary(self) -> str:
        return self.report.describe() if self.report else "skipped (validate=false)"


@dataclass
class ExportResult:
    """What ``export()`` returns: where the program is and what the manifest says about it."""

    pte_path: Path
    manifest_path: Path
    manifest: dict[str, Any]

    def summary(self) -> str:
        return f"{self.pte_path}"
