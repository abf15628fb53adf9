"""``manifest.json``: what an export wrote, typed once.

The finalize stage builds a :class:`Manifest`, the bench stage adds its numbers, and every reader (console,
sweep summary, bundles, generate, benchmarks) gets the same typed object back from :meth:`Manifest.read`.
Serialization happens in one place (:meth:`Manifest.write`); pydantic turns the JSON back into these
dataclasses, checks every closed set (``Literal``), and says which field is wrong when a file does not fit.
Manifests written by earlier versions are read too: ``exporters.compat.upgrade_manifest`` brings them up to date.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from exporters.compat import upgrade_manifest
from exporters.errors import UserError
from exporters.output.files import write_atomically

MANIFEST_FILE = "manifest.json"
#: 2: validation's reference_* fields became baseline_*, its tolerance max_ppl_increase became max_ppl_drift,
#: ``checked`` a closed set, and quantization records ``tied_embedding``.
#: 3: ``components``: the models the program holds (exporters.plan.Component), each with its methods and state.
MANIFEST_VERSION = 3

Status = Literal["ok", "failed validation"]
RunnerResult = Literal["correct", "wrong text", "fails"]
# What was compared with the eager model: the .pte in the ExecuTorch runtime, or, for a delegate this host's
# runtime cannot execute, the captured programs before lowering ("undelegated programs").
Checked = Literal["runtime", "undelegated programs"]


def ppl(value: float) -> str:
    """A perplexity for the console: two decimals, or three digits where a random-weight model's runs to dozens of
    them (``6.5e+97``)."""
    return f"{value:.2f}" if value < 1e6 else f"{value:.3g}"


@dataclass
class TensorSpec:
    name: str
    shape: list[int | str]  # the dynamic token dimension is named ("num_tokens")
    dtype: str


@dataclass
class Signature:
    """A captured method's user inputs and outputs."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


@dataclass
class MethodEntry(Signature):
    """One method of the program: its signature and how it was lowered."""

    dynamic_tokens: bool
    tokens: list[int]  # [min, max] tokens per call (a fixed-shape method of a component's own: 0 if it takes none)
    delegated_partitions: int
    lowered_once_with: str | None = None  # the method whose lowered graph this one shares (forward -> prefill)


@dataclass
class RunnerEntry:
    """What one release of ExecuTorch's stock runner does with the program."""

    result: RunnerResult  # "fails": the runner stops with an error
    prompt_method: str | None
    token_method: str | None
    why: str
    fix: str = ""  # what makes a program this runner runs correctly (empty when it does)


@dataclass
class LayoutEntry:
    """What app developers need to call the program correctly (``exporters.program.layouts``)."""

    name: str
    audience: str
    methods: dict[str, str]  # method -> its kind (prefill, decode, forward)
    prompt_method: str
    token_method: str
    call_order: str
    kv_cache: str
    stock_runners: dict[str, RunnerEntry]  # release -> outcome


@dataclass
class ProgramFile:
    file: str  # beside the manifest (export.output_name)
    size_bytes: int
    sha256: str
    storage: dict[str, int]  # bytes by kind (exporters.program.contents.storage_breakdown)


@dataclass
class DataFile:
    """The weights of a program exported with export.weights=external: a ``.ptd`` beside it, loaded with it."""

    file: str
    size_bytes: int
    sha256: str
    entries: int  # named tensors (a weight used by several methods is one entry)


@dataclass
class RuntimeNeeds:
    """What an app's runtime must do to load the program as it was validated and measured here."""

    load: str  # which files to load together, and how
    packed_once: str  # what makes the methods share one packed copy of the weights, and the cost without it


@dataclass
class ModelEntry:
    checkpoint: str
    architecture: list[str]
    family: str | None
    attention: str
    parameters: int
    converted_from: dict[str, Any] | None = None  # the GGUF file a checkpoint was converted from, and how


@dataclass
class KvCacheEntry:
    """The program's KV cache (``exporters.program.cache``): one per program, shared by every method."""

    positions: int  # get_max_context_len: the longest conversation the program holds
    tokens_per_call: int  # get_max_seq_len: the most tokens one call of the prompt method takes
    dtype: str  # what it stores: fp32, or int8 with a scale and zero point per token and head (export.kv_dtype)
    bytes_per_token: int  # one position in every layer: keys, values and any scales
    bytes: int  # every layer's buffers (windowed layers keep only their ring)
    windows: list[int | None] = field(default_factory=list)  # per layer: attention window, null = the whole cache
    attention_sink: int = 0  # positions kept forever, the rest in a ring: generation goes on past `positions`
    slots: list[int] = field(default_factory=list)  # per layer: positions its buffers hold (ring: window + call - 1)
    # Per layer, what mixes its tokens (models.decoder.Mixer); empty: attention in every layer (older manifests).
    layers: list[str] = field(default_factory=list)
    # The state of the layers that are not attention (short convolutions' last inputs): fixed, whatever the context.
    state_bytes: int = 0
    # Per layer, the earlier layer whose cache it reads instead of keeping one (Gemma 4's KV sharing), else null;
    # empty when every attention layer keeps its own. `slots` lists the caches kept.
    cache_of: list[int | None] = field(default_factory=list)

    def describe(self) -> str:
        windowed = sorted({w for w in self.windows if w is not None})
        rings = sorted({s for s, w in zip(self.slots, self.windows) if w is not None and s < self.positions})
        return (f"{self.positions} positions of {self.dtype} ({_size(self.bytes_per_token)} per token, "
                f"{_size(self.bytes)} in all), at most {self.tokens_per_call} tokens per call"
                + (f"; attention windows {windowed} on {sum(w is not None for w in self.windows)} of "
                   f"{len(self.windows)} layers" + (f" (ring buffers of {rings} slots)" if rings else "")
                   if windowed else "")
                + (f"; attention sink of {self.attention_sink}: generation goes on past the cache, each layer "
                   f"seeing the first {self.attention_sink} and the last {self.positions - self.attention_sink} positions"
                   if self.attention_sink else "; generation stops at the end of the cache")
                + (f"; beside it {_size(self.state_bytes)} of recurrent state in "
                   f"{sum(kind != 'attention' for kind in self.layers)} of {len(self.layers)} layers "
                   f"({', '.join(sorted({k for k in self.layers if k != 'attention'}))}), the same at any length"
                   if self.state_bytes else "")
                + (f"; {sum(j is not None for j in self.cache_of)} of {len(self.cache_of)} layers read an earlier "
                   "layer's cache instead of keeping one" if any(j is not None for j in self.cache_of) else ""))


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


@dataclass
class SpeculativeCheck:
    """The verify method (speculative decoding's check) against the eager model, and speculation against plain
    decoding in the program itself, on the validation text's first prompt."""

    verify_kl: float  # mean KL(eager || verify) over the K + 1 positions one verify call returns
    verify_top1: float  # share of those positions whose greedy token agrees
    tokens: int  # greedy tokens generated each way
    identical: bool  # speculative greedy output == plain greedy output, token for token
    proposer: str  # what proposed the tokens: the program's draft model (draft), else the text's n-grams (lookup)
    acceptance: float  # proposals kept / proposals checked
    tokens_per_call: float  # tokens generated per call of the target after the prompt
    # Verify computes its positions in one batched call, decode one at a time: the largest difference of their logits
    # on the same tokens. Quantized kernels (8da4w) round differently by batch size, so where plain decoding's top two
    # logits are closer than that, the two may pick different tokens without either being wrong.
    kernel_noise: float = 0.0
    diverged_at: int | None = None  # the first token where they differ
    margin_there: float | None = None  # plain decoding's top-two logit gap at that token
    tie_factor: float = 4.0  # a divergence is a tie when margin_there <= tie_factor x kernel_noise

    @property
    def matches(self) -> bool:
        """Identical output, or a first divergence at a tie within the kernels' rounding."""
        return self.identical or (self.margin_there is not None and self.margin_there <= self.tie_factor * self.kernel_noise)

    def describe(self) -> str:
        if self.identical:
            verdict = f"matches plain greedy decoding over {self.tokens} tokens"
        elif self.matches:
            verdict = (f"matches plain greedy decoding until a tie at token {self.diverged_at} of {self.tokens} (top two "
                       f"{self.margin_there:.2g} apart; verify and decode differ by {self.kernel_noise:.2g})")
        else:
            verdict = f"DIFFERS FROM plain greedy decoding at token {self.diverged_at} of {self.tokens}"
        return (f"verify KL {self.verify_kl:.2g}; {self.proposer} speculation {verdict} ({self.acceptance:.0%} of "
                f"proposals kept, {self.tokens_per_call:.2f} tokens per call)")


@dataclass
class ValidationReport:
    """The program against the eager model it came from, on the validation text (``exporters.runtime.quality``)."""

    passed: bool
    failures: list[str]  # each measure outside its tolerance, with value and limit
    checked: Checked
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
    baseline_perplexity: float  # of the unquantized model, as loaded
    baseline_dtype: str  # the dtype it was scored in: the checkpoint's (fp32, or bf16 for a bf16 checkpoint)
    forward_kl: float | None  # KL(prefill || forward) on the first prompt, when both exist
    # Most KL over the first window of token_embedding -> text_decoder against the prompt and step methods, when both
    # paths exist (a vision-language program's text, as ExecuTorch's MultimodalRunner drives it).
    text_decoder_kl: float | None = None
    tolerance: dict[str, float] = field(default_factory=dict)
    # The dtype the delegate computed in when its device chose one coarser than the program's (OpenVINO's CPU
    # plugin on a CPU with bf16 units): the tolerance is then the looser of the quant option's and that dtype's.
    runs_in: str | None = None
    per_window: list[dict[str, Any]] = field(default_factory=list)
    # The program's KV cache is quantized (export.kv_dtype) and the eager side kept this cache dtype instead: the
    # measures include what the quantized cache costs, and the tolerance adds validation.int8_kv's.
    eager_kv_dtype: str | None = None
    speculative: SpeculativeCheck | None = None  # the program has a verify method
    # The program against the unquantized model as loaded (baseline_dtype), on the same positions: what the export
    # costs in all (llama.cpp's --kl-divergence), where kl_mean is only the program against its quantized eager model.
    kl_vs_unquantized: float | None = None
    top1_vs_unquantized: float | None = None

    @property
    def ppl_increase(self) -> float:
        """The quality loss: the program's perplexity over the unquantized baseline's, minus one."""
        return self.perplexity / self.baseline_perplexity - 1

    @property
    def _shown_increase(self) -> float:
        return 0.0 if abs(self.ppl_increase) < 5e-4 else self.ppl_increase  # no "-0.0%"

    def quality(self) -> str:
        """``perplexity 21.4 (eager 21.1, unquantized fp32 16.8, +27%); against unquantized fp32: KL 0.12, top-1
        84.0%``: the numbers people choose a scheme by."""
        cost = (f"; against unquantized {self.baseline_dtype}: KL {self.kl_vs_unquantized:.2g}, top-1 "
                f"{self.top1_vs_unquantized:.1%}" if self.kl_vs_unquantized is not None
                and self.top1_vs_unquantized is not None else "")
        return (f"perplexity {ppl(self.perplexity)} (eager {ppl(self.eager_perplexity)}, unquantized "
                f"{self.baseline_dtype} {ppl(self.baseline_perplexity)}, {self._shown_increase:+.1%}){cost}")

    def describe(self) -> str:
        verdict = "passed" if self.passed else "FAILED (" + "; ".join(self.failures) + ")"
        where = "" if self.checked == "runtime" else " [undelegated programs: the delegate cannot run on this host]"
        if self.runs_in:
            where += f" [the delegate computed in {self.runs_in}, its device's choice here: tolerance of quant={self.runs_in}]"
        if self.eager_kv_dtype:
            where += f" [against the same weights with an {self.eager_kv_dtype} KV cache]"
        t = self.tolerance
        return (f"{verdict}{where}: {self.scored_tokens} tokens of {self.text} through "
                f"{self.methods['prompt']}+{self.methods['step']}, KL {self.kl_mean:.2g} (limit {t['max_kl']:.2g}), "
                f"top-1 {self.top1_agreement:.1%} (min {t['min_top1']:.0%}), top-5 overlap {self.top5_overlap:.1%}, "
                f"{self.quality()}" + (f"; {self.speculative.describe()}" if self.speculative else ""))


@dataclass
class AppliedScheme:
    scheme: str
    torchao_config: str
    torchao_args: dict[str, Any]  # of the requested scheme and group size
    layers: dict[str, int]  # layer -> group size actually used (0 = one scale per row)
    # Layers the requested group size does not fit -> what they got instead ("8da8w, one scale per row").
    fallbacks: dict[str, str] = field(default_factory=dict)
    # How the codes and scales were chosen (quant.algorithm): hqq, affine, or gptq / distill / signround (calibrated).
    algorithm: str = "hqq"
    # Layers given more bits by quant.size_budget -> the scheme they got (one scale per row).
    upgraded: dict[str, str] = field(default_factory=dict)


@dataclass
class CalibrationRecord:
    """The text a calibrated algorithm learned from, so a result can be traced (and never validated on it)."""

    algorithm: str
    source: str
    sha256: str  # of the text as read
    tokens: int  # tokens used (quant.calibration.max_tokens at most)
    windows: int
    seconds: float  # calibration and solving, in the quantize stage
    steps: int | None = None  # signround: the signed-gradient steps of each decoder layer; distill: Adam's, in all
    # distill: the mean KL to the unquantized model over the first and the last pass over the calibration windows
    # (learning's own measure of progress, on the text it learns from; validation's is on other text).
    kl_first_pass: float | None = None
    kl_last_pass: float | None = None


@dataclass
class RotationRecord:
    """What quant.rotation / quant.online_hadamard rotated, with which matrices, and what runs at run time."""

    residual: str | None  # R1: "randomized Hadamard 576x576 (36 x 16)"
    heads: str | None  # R2
    online: list[str] = field(default_factory=list)  # run-time matrices: where, and their size
    # Residual channels R1 left in place (their peak on the calibration text over MASSIVE_RATIO x the median
    # channel's), largest first, and the largest peak ratio found.
    massive_channels: list[int] = field(default_factory=list)
    massive_ratio: float = 0.0
    seed: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        kept = f" but {len(self.massive_channels)} massive channel(s)" if self.massive_channels else ""
        fused = " and ".join(p for p in (self.residual and f"residual stream{kept}", self.heads and "heads") if p)
        online = f"{len(self.online)} run-time" if self.online else ""
        return "rotated (" + ", ".join(p for p in (fused, online) if p) + ")"


@dataclass
class MixedPrecisionRecord:
    """quant.size_budget: each candidate layer's measured KL at its low and high precision, and the choice."""

    budget: float
    uniform_bytes: int  # estimated weight bytes with every candidate at its low precision
    chosen_bytes: int  # with the upgraded ones at high precision
    all_high_bytes: int  # with every candidate at high precision
    tokens: int  # calibration tokens the KL was measured on
    seconds: float
    # layer -> [KL low, KL high] (mean nats per token, that layer alone rounded, against the unrounded model)
    sensitivity: dict[str, list[float]] = field(default_factory=dict)
    upgraded: list[str] = field(default_factory=list)  # most KL saved per byte first

    def describe(self) -> str:
        return (f"{len(self.upgraded)} of {len(self.sensitivity)} layers at 8 bits "
                f"({self.chosen_bytes / self.uniform_bytes:.3f}x of uniform, budget {self.budget}x; "
                f"measured in {self.seconds:.0f} s)")


@dataclass
class Pt2eRecord:
    """quant.pt2e: the backend quantizer that quantized the captured graph's linear layers, and what it made."""

    quantizer: str  # exporters.config.Pt2eQuantizer
    backend: str
    weights: str  # "int8 per channel"
    activations: str  # static (scales calibrated on text), dynamic (per token at run time) or none (float)
    linears: int  # linear layers of the graph given integer weights
    seconds: float  # capture, prepare, calibrate and convert
    calibration: CalibrationRecord | None = None  # static activations: the text their scales came from

    def describe(self) -> str:
        acts = {"static": "static 8-bit activations", "dynamic": "dynamic int8 activations"}.get(self.activations,
                                                                                                 "float activations")
        return (f"pt2e {self.quantizer}: {self.linears} linears with {self.weights} weights, {acts}"
                + (f", calibrated on {self.calibration.tokens} tokens" if self.calibration else "")
                + f" in {self.seconds:.0f} s")


@dataclass
class AppliedQuantization:
    """Exactly what was done to the model, for the manifest."""

    dtype: str = "fp32"
    linear: AppliedScheme | None = None
    lm_head: AppliedScheme | None = None
    embedding: AppliedScheme | None = None
    adapters: AppliedScheme | None = None  # LoRA adapters' A and B (quant.adapters), when quantized
    calibration: CalibrationRecord | None = None  # with a calibrated quant.algorithm
    mixed: MixedPrecisionRecord | None = None  # with quant.size_budget
    pt2e: Pt2eRecord | None = None  # with quant.pt2e (set by the pt2e stage, after capture of the prompt graph)
    rotation: RotationRecord | None = None  # with quant.rotation or quant.online_hadamard
    untied_embeddings: bool = False
    notes: list[str] = field(default_factory=list)
    tied_embedding: str = "not tied"  # exporters.quant.tied.TiedEmbedding

    def describe(self) -> str:
        parts = [self.dtype] + ([self.rotation.describe()] if self.rotation else [])
        for role in ("linear", "lm_head", "embedding", "adapters"):
            applied = getattr(self, role)
            if applied:
                algorithm = "" if applied.algorithm == "hqq" else f" {applied.algorithm}"
                n = len(applied.layers)  # matrices, not decoder layers: a layer holds seven linears
                parts.append(f"{role} {applied.scheme}{algorithm} ({n} {'matrix' if n == 1 else 'matrices'})")
        if self.mixed:
            parts.append(f"mixed precision: {self.mixed.describe()}")
        if self.pt2e:
            parts.append(self.pt2e.describe())
        if self.calibration:
            c = self.calibration
            learned = (f" (KL to the unquantized model {c.kl_first_pass:.4f} in the first pass, {c.kl_last_pass:.4f} "
                       f"in the last)" if c.kl_first_pass is not None else "")
            parts.append(f"calibrated on {c.tokens} tokens in {c.seconds:.0f} s{learned}")
        return ", ".join(parts) + (", embeddings untied" if self.untied_embeddings else "")


@dataclass
class Remedy:
    """A change of the quant config measured on the eager model: what it wins back and what it costs."""

    change: str  # the overrides that make it: "quant.lm_head=8da8w quant.lm_head_group_size=0"
    what: str  # "8-bit lm_head"
    perplexity: float  # of the eager model with the change, on the validation text
    recovered: float  # share of the quantization's perplexity increase it wins back (1.0: all of it)
    extra_mb: float  # weight bytes it adds, in MB (0 for a calibrated algorithm)

    def describe(self) -> str:
        return f"{self.change} ({self.what}) recovers {self.recovered:.0%} for {self.extra_mb:+.2f} MB"


@dataclass
class QualityWarning:
    """The perplexity increase over the unquantized model passed ``validation.warn_ppl_increase``; what would
    win it back, measured on this model (exporters.quant.advice), best recovery per MB first."""

    threshold: float
    ppl_increase: float
    remedies: list[Remedy] = field(default_factory=list)
    seconds: float = 0.0
    # Remedies that apply but were not measured (their overrides -> why: the memory estimate said they would not fit).
    unmeasured: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        head = (f"perplexity {self.ppl_increase:+.1%} over the unquantized model (warning above "
                f"{self.threshold:.0%}, validation.warn_ppl_increase)")
        skipped = "".join(f"; not measured: {change} ({why})" for change, why in self.unmeasured.items())
        if not self.remedies:
            return (head + "; no measured remedy for this scheme: compare others in a sweep (docs/quality.md)"
                    + skipped)
        return head + "; measured: " + "; ".join(r.describe() for r in self.remedies) + skipped


@dataclass
class MethodLowering:
    """One captured method's share of the lower stage, in seconds (its aliases are emitted from it, not lowered)."""

    to_edge_s: float  # decompositions and the edge dialect's passes
    decompositions: int  # how many times the method was retraced by run_decompositions
    partition_s: float  # the backend's partitioner choosing what it takes
    preprocess_s: float  # the backend compiling those partitions (its passes and serialization)
    partitions: int


@dataclass
class LoweringTimes:
    """Where the lower stage's seconds (``timings_s.lower``) went, so that a slower lowering shows in a manifest."""

    # by captured method; empty for a backend with no partitioner (the one that tells which method ExecuTorch converts)
    methods: dict[str, MethodLowering]
    passes_s: dict[str, float]  # each pass (edge dialect and backend) by class, summed over methods and partitions
    pass_runs: dict[str, int]
    other_s: float  # the rest: the edge program manager, the user passes, partitions cut out of the graphs, checks
    # ExecuTorch's to_edge_transform_and_lower, which the above add up to (timings_s.lower adds the stage's own steps)
    total_s: float = 0.0

    def describe(self) -> str:
        slowest = sorted(self.passes_s.items(), key=lambda kv: -kv[1])[:3]
        per_method = ", ".join(f"{name} {m.to_edge_s + m.partition_s + m.preprocess_s:.0f} s"
                               for name, m in self.methods.items())
        return (f"seconds per method: {per_method}, the rest {self.other_s:.0f} s; slowest passes: "
                + ", ".join(f"{name} {s:.0f} s ({self.pass_runs[name]} runs)" for name, s in slowest))


@dataclass
class Resources:
    """The export itself (every stage before finalize): what a sweep compares configs by."""

    wall_s: float
    peak_rss_mb: float  # MiB (the kernel's VmHWM), every stage before finalize
    peak_stage: str | None = None  # the stage in which the peak was reached
    # The load stage's estimate (exporters/plan/footprint.py) of the same peak, with advise's when advise ran, in MiB:
    # benchmarks.memory_estimate holds the two within 15% on every benchmark preset.
    estimated_peak_rss_mb: float | None = None
    estimated_peak_stage: str | None = None

    def describe(self) -> str:
        where = f" (in {self.peak_stage})" if self.peak_stage else ""
        estimated = ("" if self.estimated_peak_rss_mb is None else
                     f"; estimated {self.estimated_peak_rss_mb:.0f} MB (in {self.estimated_peak_stage})")
        return f"{self.wall_s:.0f} s, peak RSS {self.peak_rss_mb:.0f} MB{where}{estimated}"


@dataclass(frozen=True)
class Speed:
    """Prefill and decode throughput of a program in the runtime (``exporters.runtime.speed.measure_speed``)."""

    prompt_tokens: int
    steps: int
    repeats: int
    prefill_tokens_per_s: float  # prompt tokens / time of the prompt call(s), median
    decode_tokens_per_s: float  # steps / time of the one-token calls, median
    prompt_method: str
    step_method: str


@dataclass(frozen=True)
class BenchResult(Speed):
    """The written program measured in the runtime as an app runs it (``exporters.stages.bench``)."""

    rss_after_load_mb: float  # a fresh process loading prompt_method and step_method (XNNPACK weight cache on)
    seconds: float  # the measurement itself
    # The same with the pip runtime's default (XNNPACK's weight cache off: each method packs its own weights).
    rss_after_load_without_weight_cache_mb: float | None = None
    # PSS with the weight cache: a data file's pages, mapped once per method that reads them, counted once.
    pss_after_load_mb: float | None = None

    def describe(self) -> str:
        without, pss = self.rss_after_load_without_weight_cache_mb, self.pss_after_load_mb
        notes = [f"PSS {pss:.0f} MB"] if pss is not None else []
        notes += [f"{without:.0f} MB without XNNPACK's weight cache"] if without is not None else []
        return (f"prefill {self.prefill_tokens_per_s:.0f} tok/s ({self.prompt_tokens} tokens), decode "
                f"{self.decode_tokens_per_s:.0f} tok/s ({self.steps} steps), RSS after load "
                f"{self.rss_after_load_mb:.0f} MB" + (f" ({'; '.join(notes)})" if notes else ""))


@dataclass
class AdapterEntry:
    """One LoRA adapter (``model.adapters``): where it came from, what it changes, its methods and its quality."""

    folder: str
    weights_sha256: str  # of its adapter_model.safetensors
    rank: list[int]  # the ranks of its layers (one value unless rank_pattern varies it)
    lora_alpha: float
    use_rslora: bool
    layers: int  # linear layers it changes
    targets: list[str]  # which kinds of layer (q_proj, v_proj, ...)
    dtype: str  # what its A and B matrices are stored as: the model's dtype, or quant.adapters' scheme (8da8w)
    methods: dict[str, str]  # base method -> this adapter's method (prefill -> chat_prefill)
    validation: ValidationReport | None = None  # its methods against the eager model with it applied
    # export.weights=external: its A and B matrices in their own .ptd (<stem>.<adapter>.ptd), loaded with the base's
    # to run its methods; another adapter of the same name, ranks and targets exported the same way can replace it.
    data: DataFile | None = None


@dataclass
class SwappableEntry:
    """export.adapters=swappable: the base's methods read LoRA slots, which the method ``set_adapter`` writes and every
    method shares (as the KV cache); all zeros (how the program starts) is the base model. docs/adapters.md."""

    method: str  # set_adapter
    # Its inputs, in order: <kind>.A = Aᵀ [layers, 1, in, rank] and <kind>.B = (scale·B)ᵀ [layers, 1, rank, out], zero past
    # an adapter's rank and where it changes nothing (python -m exporters.adapter lays out any PEFT folder so).
    inputs: list[TensorSpec]
    slots: dict[str, Any]  # models.lora_slots.SlotGeometry.to_json(): layers, rank, dtype, each target's shape
    # Each adapter given at export: adapters/<name>.ptd, its tensors named as set_adapter's inputs.
    adapters: dict[str, DataFile] = field(default_factory=dict)
    how: str = ""  # how an app swaps adapters (C++ and Python)


@dataclass
class HeadVocabularyEntry:
    """A component whose lm_head scores a few tokens (draft.vocab: FR-Spec)."""

    tokens: int  # how many it scores (the program's get_draft_vocab lists them)
    ranked_by: str  # "tokenizer order", or the text whose token counts ranked them (draft.vocab_text)
    # the share of the validation text's tokens among them (the rest it never proposes); None without validation
    coverage: float | None


@dataclass
class PromptQuality:
    """What quantization cost an encoder's prompt path: the program against the unquantized encoder and decoder on the
    same prompt and tokens (exporters.validation.encoder_prompt)."""

    encoder_cosine: float  # least cosine of one position's embedding, quantized encoder against unquantized
    kl_mean: float  # KL(unquantized || program) over the prompt's last position and each step, mean
    kl_max: float  # and most
    top1: float  # share of those positions where both pick the same token

    def describe(self) -> str:
        return (f"against the unquantized model: encoder cosine {self.encoder_cosine:.4f}, prompt KL mean "
                f"{self.kl_mean:.3g} (max {self.kl_max:.3g}), top-1 {self.top1:.0%}")


@dataclass(kw_only=True)
class EncoderCheck:
    """An encoder's method (vision_encoder, audio_encoder) against its own eager model on one input, and a prompt
    around its embeddings through the program's text_decoder against the eager decoder on the same embeddings
    (exporters.validation.encoder_prompt)."""

    passed: bool
    failures: list[str]
    max_abs_error: float  # of the embeddings, program against eager
    cosine: float  # the least cosine similarity of one position's embedding, program against eager
    prompt_tokens: int  # text, the encoder's positions and text of the prompt
    kl_max: float  # the most KL over the prompt's last position and each greedy step after it
    greedy_tokens: list[int]  # the program's greedy continuation of the prompt
    eager_choices: list[int]  # the eager decoder's greedy choice at each step, on the program's tokens
    tolerance: dict[str, float] = field(default_factory=dict)
    unquantized: PromptQuality | None = None  # what quantization cost the path (reported, not judged)

    def describe(self) -> str:
        return (f"{'passed' if self.passed else 'FAILED'} (embeddings cosine {self.cosine:.4f}, prompt KL "
                f"{self.kl_max:.2g})" + (f"; {self.unquantized.describe()}" if self.unquantized else ""))


@dataclass(kw_only=True)
class VisionCheck(EncoderCheck):
    image: str  # what was encoded: a seeded image of the processor's normalized pixels


@dataclass(kw_only=True)
class AudioCheck(EncoderCheck):
    recording: str  # what was encoded: the validation recording, and its length


@dataclass
class AssistantCheck:
    """Gemma 4's assistant's method in the program against the eager assistant over the eager decoder's state: its
    proposals after prompts of the validation text (each of ``positions`` tokens, then the token at that position)."""

    tokens: int  # proposals per call (draft.tokens)
    positions: list[int]
    first_agreement: float  # share of calls whose first proposal is the eager one
    all_agreement: float  # share of calls whose every proposal is
    min_first: float  # the tolerance's min_top1, which first_agreement must reach
    passed: bool

    def describe(self) -> str:
        return (f"{'passed' if self.passed else 'FAILED'}: first proposal as the eager assistant's after "
                f"{self.first_agreement:.0%} of {len(self.positions)} prompts (at least {self.min_first:.0%}), every "
                f"one of {self.tokens} after {self.all_agreement:.0%}")


@dataclass
class VisionEntry:
    """What an app needs to give the program an image (the processor's steps, done before vision_encoder)."""

    family: str  # models.vision: llava, gemma3, idefics3, lfm2_vl
    image_size: int  # every image resized to image_size x image_size
    tokens_per_image: int  # embedding positions an image takes in text_decoder
    image_token_id: int  # the token each image position takes in a prompt (the runner splits the prompt there)
    image_token: str | None  # its text
    prompt_marker: str | None  # what a prompt writes where an image goes (the processor expands it into the image's tokens)
    input: str  # vision_encoder's input: shape, dtype and layout
    preprocessing: dict[str, Any]  # the processor's rescale factor, mean and std (pixels = (x * rescale - mean) / std)
    quantization: str  # quant.vision, as applied
    check: VisionCheck | None = None

    def describe(self) -> str:
        check = "not validated" if self.check is None else self.check.describe()
        return (f"{self.family}, {self.image_size}x{self.image_size} images to {self.tokens_per_image} positions of "
                f"token {self.image_token or self.image_token_id}, {self.quantization}; {check}")


@dataclass
class AudioEntry:
    """What an app needs to give the program audio (the preprocessor beside it makes audio_encoder's input)."""

    family: str  # models.audio_language: voxtral, qwen2_audio, gemma4, granite_speech
    sample_rate: int
    mel_bins: int
    frames: int  # log-mel frames per 30 s window (a recording of any length: the most one call takes)
    tokens_per_window: int  # embedding positions a window takes in text_decoder (any length: the most a call gives)
    max_windows: int  # windows one call of audio_encoder takes (any length: 1 recording)
    audio_token_id: int  # the token each audio position takes in a prompt (the runner splits the prompt there)
    audio_token: str | None  # its text
    input: str  # audio_encoder's input: shape, dtype and layout
    preprocessor: str | None  # the preprocessor program beside this one (raw samples -> features)
    quantization: str  # quant.audio, as applied
    check: AudioCheck | None = None
    # A recording of any length (Gemma 4): log-mel frames a position (0: whole 30 s windows), and the tokens written
    # just before and after the audio's positions in a prompt, with their text.
    frames_per_token: int = 0
    begin_token_id: int | None = None
    begin_token: str | None = None
    end_token_id: int | None = None
    end_token: str | None = None
    # Granite Speech: time-major frames [1, frames, bins] (50 a second), frame_window of them to frame_window /
    # frames_per_token positions, the last window partial (0: Gemma 4's whole positions)
    frame_window: int = 0
    frames_per_second: int = 100
    # The checkpoint's LoRA adapter on the decoder for prompts with audio, which text_decoder applies (Granite Speech's);
    # the text methods compute the base
    adapter: str | None = None

    def describe(self) -> str:
        check = "not validated" if self.check is None else self.check.describe()
        if self.frame_window:
            heard = f"; text_decoder applies the adapter {self.adapter}" if self.adapter else ""
            return (f"{self.family}, {self.mel_bins}-wide frames, {self.frame_window} frames to "
                    f"{self.frame_window // self.frames_per_token} positions of token "
                    f"{self.audio_token or self.audio_token_id}, one recording of up to {self.tokens_per_window} "
                    f"positions a call, {self.quantization}{heard}; {check}")
        if self.frames_per_token:
            return (f"{self.family}, {self.mel_bins} mel bins, {self.frames_per_token} frames a position of token "
                    f"{self.audio_token or self.audio_token_id}, one recording of up to {self.tokens_per_window} "
                    f"positions a call, {self.quantization}; {check}")
        return (f"{self.family}, {self.mel_bins} mel bins x {self.frames} frames a window to {self.tokens_per_window} "
                f"positions of token {self.audio_token or self.audio_token_id}, up to {self.max_windows} window(s) a "
                f"call, {self.quantization}; {check}")


@dataclass
class SpeechCheck:
    """A speech program against its eager model on a validation recording (exporters.validation.speech): the
    encoder's states, the decoder's logits along the eager transcript, and the two greedy transcripts; and what
    quantization cost the transcript against the unquantized model (reported, not judged)."""

    passed: bool
    failures: list[str]
    recording: str  # what was transcribed, and its length
    encoder_cosine: float  # the least cosine similarity of one position's state, program against eager
    kl_mean: float  # decoder logits along the eager transcript, program against eager
    kl_max: float
    top1: float  # share of positions whose top token agrees
    transcript: str  # the program's greedy transcript
    eager_transcript: str  # the eager (quantized) model's
    unquantized_transcript: str  # the model's as loaded, before quantization
    identical: bool  # the program's tokens are the eager model's, token for token
    wer_vs_eager: float  # word error rate of the program's transcript against the eager model's
    wer_vs_unquantized: float  # and against the unquantized model's: what quantization cost
    tolerance: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        return (f"{'passed' if self.passed else 'FAILED'}: transcript {'identical to' if self.identical else 'differs from'} "
                f"eager (WER {100 * self.wer_vs_eager:.1f}%), {100 * self.wer_vs_unquantized:.1f}% against unquantized; "
                f"encoder cosine {self.encoder_cosine:.4f}, decoder KL max {self.kl_max:.2g}, top-1 {100 * self.top1:.1f}%")


@dataclass
class SpeechEntry:
    """What an app needs to transcribe with the program (ExecuTorch's AsrRunner, or its own loop)."""

    family: str  # whisper
    sample_rate: int
    mel_bins: int
    chunk_seconds: int
    frames: int  # encoder input frames per window
    max_tokens: int  # positions of text_decoder's cache: prompt and transcript of one window
    tokens: dict[str, Any]  # start, end, transcribe, translate, no_timestamps, languages (code -> id)
    preprocessor: str | None  # the preprocessor program beside this one (raw samples -> features)
    quantization: dict[str, str]  # encoder and decoder, as applied
    check: SpeechCheck | None = None


@dataclass
class ComponentEntry:
    """One model the program holds (``exporters.plan.Component``): what it is, its methods, its variants, its state."""

    kind: str  # exporters.plan.ComponentKind: "decoder", "draft" (vision_encoder, text_decoder come next)
    methods: list[str]  # its methods in the program, each adapter's included
    adapters: list[str]  # its variants: LoRA adapters applied by methods of their own over its stored weights
    checkpoint: str
    parameters: int | None
    state: list[str]  # what its methods share in the runtime, each a section of this manifest ("kv_cache")
    # A component other than the decoder (whose are the manifest's own "quantization" and "validation"): how it was
    # quantized, and its methods against its own eager model.
    quantization: AppliedQuantization | None = None
    validation: ValidationReport | None = None
    family: str | None = None
    vocabulary: HeadVocabularyEntry | None = None
    vision: VisionEntry | None = None  # the vision encoder's
    audio: AudioEntry | None = None  # an audio-language model's audio encoder
    speech: SpeechEntry | None = None  # a speech-recognition model's (Whisper)
    assistant: AssistantCheck | None = None  # Gemma 4's assistant's (its method against the eager assistant)


@dataclass
class Manifest:
    status: Status
    program: ProgramFile
    methods: dict[str, MethodEntry]
    layout: LayoutEntry
    constant_methods: dict[str, Any]
    model: ModelEntry
    quantization: AppliedQuantization
    validation: ValidationReport | None  # None with validate=false
    tokenizer_files: list[str]
    timings_s: dict[str, float]  # seconds per stage, every stage before finalize
    resources: Resources
    versions: dict[str, str]
    config: dict[str, Any]  # the resolved config the export ran with
    bench: BenchResult | None = None  # None unless the bench stage ran
    data: DataFile | None = None  # the weights' file with export.weights=external; None: they are in the program
    runtime: RuntimeNeeds | None = None  # what a runtime needs to load the program as measured
    adapters: dict[str, AdapterEntry] = field(default_factory=dict)  # model.adapters, by name
    # The quantization cost more perplexity than validation.warn_ppl_increase, and what would win it back.
    quality_warning: QualityWarning | None = None
    kv_cache: KvCacheEntry | None = None  # None in manifests written before it was recorded
    # The models the program holds, by name (version 3; older manifests read as one "decoder").
    components: dict[str, ComponentEntry] = field(default_factory=dict)
    swappable: SwappableEntry | None = None  # export.adapters=swappable: the LoRA slots and the adapters' files
    lowering: LoweringTimes | None = None  # the lower stage's seconds per method and per pass
    version: int = MANIFEST_VERSION

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.validation is not None:  # the one line people choose a scheme by, readable without code
            data["validation"] = {"quality": self.validation.quality(), **data["validation"]}
        for name, adapter in self.adapters.items():
            if adapter.validation is not None:
                data["adapters"][name]["validation"] = {"quality": adapter.validation.quality(),
                                                        **data["adapters"][name]["validation"]}
        return data

    @property
    def files(self) -> set[str]:
        """The files of this export in its run folder: the program, its data files, a speech program's preprocessor, the
        tokenizer's, the manifest."""
        data = [d.file for d in (self.data, *(a.data for a in self.adapters.values())) if d is not None]
        swapped = [d.file for d in self.swappable.adapters.values()] if self.swappable else []
        beside = [entry.preprocessor for c in self.components.values() for entry in (c.speech, c.audio)
                  if entry is not None and entry.preprocessor]
        return {self.program.file, *data, *swapped, *beside, *self.tokenizer_files, MANIFEST_FILE}

    @property
    def passed(self) -> bool:
        """Validation passed for the base, every adapter and every other component (True when it did not run)."""
        reports = [self.validation, *(a.validation for a in self.adapters.values()),
                   *(c.validation for c in self.components.values())]
        return all(r is None or r.passed for r in reports)

    def write(self, path: Path) -> None:
        """Write atomically: a reader never sees half a manifest."""
        write_atomically(path, (json.dumps(self.to_dict(), indent=2) + "\n").encode())

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        """The manifest at ``path`` (a file, or the run folder holding ``manifest.json``)."""
        from pydantic import TypeAdapter, ValidationError

        path = path / MANIFEST_FILE if path.is_dir() else path
        try:
            return TypeAdapter(cls).validate_python(upgrade_manifest(json.loads(path.read_bytes())))
        except FileNotFoundError:
            raise UserError(f"{path} does not exist: point at a run folder of a finished export.") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not JSON ({e}): the file is damaged. Re-export the model.") from None
        except ValidationError as e:
            raise UserError(f"{path} is not a manifest this version of llm-exporters writes "
                            f"({e.error_count()} problems, first: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}). "
                            "Re-export the model to get a current manifest.") from None


def bundle_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a release bundle (``exporters.package``: its own format, with a ``bundle`` key) at ``path``
    (a file or a folder), None if it is a run's manifest or there is none."""
    path = path / MANIFEST_FILE if path.is_dir() else path
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_bytes())
    except json.JSONDecodeError:
        return None  # Manifest.read says what is wrong with it
    return raw if isinstance(raw, dict) and "bundle" in raw else None


def program_in(run_dir: Path) -> Path:
    """The program of a run folder (the file its manifest names: ``export.output_name``) or of a release bundle
    (the ``.pte`` its files list), else model.pte."""
    bundle = bundle_manifest(run_dir)
    if bundle is not None:
        return run_dir / next((f for f in bundle.get("files", {}) if f.endswith(".pte")), "model.pte")
    name = Manifest.read(run_dir).program.file if (run_dir / MANIFEST_FILE).is_file() else "model.pte"
    return run_dir / name
