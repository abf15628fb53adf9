"""The typed artifacts passed from stage to stage.

Each artifact keeps what later stages need and drops what they do not (the lowered
``EdgeProgramManager`` is not carried past emit, so its memory can be freed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporters.methods import MethodSpec
from exporters.quality import TextWindows, perplexity
from exporters.quantization import AppliedQuantization
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
    signatures: dict[str, dict[str, Any]]
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
    aliases: dict[str, str] = field(default_factory=dict)  # method -> the method whose lowered graph it shares

    def summary(self) -> str:
        return f"{self.size_bytes / 1e6:.2f} MB"


@dataclass
class ValidationReport:
    """The program against the eager model it came from, on the validation text (``exporters.quality``)."""

    passed: bool
    failures: list[str]  # each measure outside its tolerance, with value and limit
    # What was compared with the eager model: the .pte in the ExecuTorch runtime, or (for a delegate
    # this host cannot run) the captured programs before delegation.
    checked: str
    text: str
    methods: dict[str, str | None]  # prompt / step method driven, and forward when checked against prefill
    windows: int
    prompt_tokens: int
    scored_tokens: int
    kl_mean: float
    kl_max: float
    top1_agreement: float
    top5_overlap: float
    max_abs_error: float
    max_rel_error: float
    perplexity: float  # of the program
    eager_perplexity: float  # of the eager model quantized the same way
    reference_perplexity: float  # of the unquantized model
    reference_dtype: str
    forward_kl: float | None  # KL(prefill || forward) on the first prompt, when both exist
    tolerance: dict[str, float] = field(default_factory=dict)
    per_window: list[dict[str, Any]] = field(default_factory=list)

    @property
    def increase_over_reference(self) -> float:
        return self.perplexity / self.reference_perplexity - 1

    def quality(self) -> str:
        """``perplexity 21.4 (eager 21.1, fp32 16.8, +27%)``: the number people choose a scheme by."""
        return (f"perplexity {self.perplexity:.2f} (eager {self.eager_perplexity:.2f}, {self.reference_dtype} "
                f"{self.reference_perplexity:.2f}, {self.increase_over_reference:+.1%})")

    def describe(self) -> str:
        verdict = "passed" if self.passed else "FAILED (" + "; ".join(self.failures) + ")"
        where = "" if self.checked == "runtime" else " [captured programs only: the delegate cannot run on this host]"
        t = self.tolerance
        return (f"{verdict}{where}: {self.scored_tokens} tokens of {self.text} through "
                f"{self.methods['prompt']}+{self.methods['step']}, KL {self.kl_mean:.2g} (limit {t['max_kl']:.2g}), "
                f"top-1 {self.top1_agreement:.1%} (min {t['min_top1']:.0%}), top-5 overlap {self.top5_overlap:.1%}, "
                f"{self.quality()}")


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
        from exporters.benchmark import describe_bench

        bench = self.manifest.get("bench")
        return describe_bench(bench) if bench else f"{self.pte_path}"
