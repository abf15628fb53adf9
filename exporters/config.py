"""Structured-config schema for ``conf/``: every group option is checked against these dataclasses.

Hydra merges the YAML files onto ``ExportConfig``, so a misspelt field or a wrong type fails at
composition with a message naming the field. Cross-field rules (is this quant usable on this
backend?) are checked in :func:`check_config` with the allowed alternatives spelled out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from exporters.errors import UserError

# The config groups: inside the installed package (a wheel), else conf/ at the top of the checkout.
CONF_DIR = next(p for p in (Path(__file__).resolve().parent / "conf", Path(__file__).resolve().parent.parent / "conf")
                if (p / "config.yaml").is_file())


@dataclass
class ArchOverrides:
    """Architecture fields; ``null`` means "take it from the checkpoint's config.json"."""

    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    num_hidden_layers: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    vocab_size: Optional[int] = None
    tie_word_embeddings: Optional[bool] = None
    rope_theta: Optional[float] = None
    rms_norm_eps: Optional[float] = None
    sliding_window: Optional[int] = None


@dataclass
class ModelConfig:
    name: str = MISSING
    # Model family (a key of models.families.FAMILIES): the checkpoint must be of this family, and
    # random_init without a checkpoint builds one. null = take the family from config.json.
    family: Optional[str] = None
    # Which loader builds the checkpoint directory: "hf" reads model.checkpoint, "tiny" writes a
    # deterministic tiny checkpoint of model.family (with tokenizer) into the run folder first.
    source: str = "hf"
    checkpoint: Optional[str] = None
    # Build the architecture with seeded random weights (benchmarks, size studies): needs config.json
    # from model.checkpoint, or every field of model.arch.
    random_init: bool = False
    seed: int = 0
    arch: ArchOverrides = field(default_factory=ArchOverrides)


@dataclass
class QuantConfig:
    name: str = MISSING
    # Dtype of weights and activations left in floating point: fp32, fp16 or bf16.
    dtype: str = "fp32"
    # Scheme of the linear layers (a key of exporters.quant.schemes.LINEAR_SCHEMES), or null for none.
    linear: Optional[str] = None
    # Elements per quantization group along the input dimension; 0 = one scale per output channel.
    group_size: int = 32
    # The output projection may use its own scheme; by default it follows the linear layers.
    lm_head: Optional[str] = "${.linear}"
    lm_head_group_size: int = "${.group_size}"  # type: ignore[assignment]
    # Scheme of the token embedding (a key of exporters.quant.schemes.EMBEDDING_SCHEMES), or null.
    embedding: Optional[str] = None
    embedding_group_size: int = 32
    # How integer scales are chosen (a key of exporters.quant.schemes.QPARAMS): "hqq" as ExecuTorch's
    # export_llm does, or "affine" (min/max).
    qparams: str = "hqq"
    # Validation tolerances of the program against the eager model quantized the same way, on the
    # validation text (calibrated on SmolLM2-135M; the numbers are in each conf/quant file):
    # mean KL(eager || program) per predicted token in nats, the share of positions whose greedy token
    # agrees, and the allowed relative increase of the program's perplexity over the eager model's.
    max_kl: float = 1e-3
    min_top1: float = 0.95
    max_ppl_increase: float = 0.01


@dataclass
class BackendConfig:
    name: str = MISSING
    # Key of exporters.program.backends.PARTITIONERS; `options` are passed to it.
    partitioner: str = MISSING
    options: Dict[str, Any] = field(default_factory=dict)
    # Whether prefill/forward get a dynamic token dimension (else a fixed export.prefill_chunk).
    dynamic_shapes: bool = True
    # Attention implementation (a key of models.decoder.ATTENTION): "custom_ops" uses ExecuTorch's LLM
    # CPU kernels (runtimes must link them), "aten" plain ops any delegate can take.
    attention: str = "aten"
    # Whether this machine's ExecuTorch runtime can execute the delegate (else validation runs the
    # captured programs before delegation, and the manifest says so).
    runs_here: bool = True
    # What the backend's kernels can execute; anything else is refused at config time.
    supported_dtypes: List[str] = field(default_factory=lambda: ["fp32"])
    supported_linear: List[Optional[str]] = field(default_factory=lambda: [None])
    supported_embedding: List[Optional[str]] = field(default_factory=lambda: [None])


@dataclass
class ExportSection:
    # Longest sequence (prompt + generated) the program accepts; also the KV-cache length.
    max_seq_len: int = 128
    # Methods to capture, each a key of exporters.program.methods.METHOD_KINDS.
    methods: List[str] = field(default_factory=lambda: ["prefill", "decode", "forward"])
    # How the methods are named (a key of exporters.program.layouts.LAYOUTS): "stock" runs correctly in every
    # ExecuTorch stock runner we test; "split" uses the prefill/decode names, which ExecuTorch 1.5.1's
    # stock runner runs with two KV caches (wrong text): only for apps that share memory arenas.
    layout: str = "stock"
    # A tied, unquantized embedding/lm_head matrix: "shared" stores it once (lm_head reads the embedding's
    # copy; on XNNPACK it is then repacked at every call: SmolLM2-135M fp32 decode 32 instead of 43 tok/s,
    # .pte 539 instead of 652 MB), "copied" lets the backend keep its own packed copy for lm_head.
    tied_embedding: str = "shared"
    # Token count of prefill on static-shape backends.
    prefill_chunk: int = 32
    output_name: str = "model.pte"
    # Where to write; null = the Hydra run folder.
    output_dir: Optional[str] = None


@dataclass
class ValidationConfig:
    # A UTF-8 text to score (a few paragraphs); null = the English text shipped in exporters/data/.
    text_file: Optional[str] = None
    # Tokens of each window fed through the prompt method (prefill) at once, at most half the context;
    # the rest go through decode.
    prompt_tokens: int = 32
    # Tokens of the text scored at most (bounds the time validation takes).
    max_tokens: int = 256


@dataclass
class BenchmarkConfig:
    # Runtime speed of the written program (the bench stage): a prompt of prompt_tokens through the prompt
    # method, then steps greedy tokens one at a time; medians over repeats after one warm-up round.
    # Both are cut to fit export.max_seq_len (at most half of it for the prompt).
    prompt_tokens: int = 64
    steps: int = 64
    repeats: int = 3


@dataclass
class SearchConfig:
    # The trial objective of an Optuna search (--config-name search): a numeric column of the sweep
    # summary (exporters.sweeps.summary.JobRow), e.g. size_mb, decode_tok_s, ppl_increase; the sweeper's
    # direction says whether it is minimized or maximized.
    objective: str = "size_mb"
    # Trials whose perplexity increase over fp32 is above this are infeasible (scored inf); null = no bound.
    max_ppl_increase: Optional[float] = None


@dataclass
class SweepConfig:
    # Memory one export job needs, in GB (SmolLM2-135M about 3, a 1B model about 10: the peak RSS column
    # of a sweep summary): the local_parallel launcher runs as many jobs at once as fit in memory.
    job_memory_gb: int = 4


@dataclass
class ExportConfig:
    model: ModelConfig = MISSING
    quant: QuantConfig = MISSING
    backend: BackendConfig = MISSING
    export: ExportSection = field(default_factory=ExportSection)
    validate: bool = True
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    # Measure the program's speed and memory in the runtime after writing it (manifest "bench").
    # null = on in sweeps (-m), off for a single export.
    bench: Optional[bool] = None
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    # Show library warnings, library logging and the ExecuTorch runtime's own output on the console.
    verbose: bool = False


def register_configs() -> None:
    """Make the schema known to Hydra (``conf/config.yaml`` lists it first in its defaults), and the resolvers
    the launcher presets use. The commands call it before Hydra composes; calling it again changes nothing."""
    from exporters.sweeps.resolvers import RESOLVERS

    ConfigStore.instance().store(name="export_schema", node=ExportConfig)
    for name, resolver in RESOLVERS.items():
        OmegaConf.register_new_resolver(name, resolver, replace=True)


def _names(values: Any) -> str:
    return ", ".join("none" if v is None else str(v) for v in values)


def check_config(cfg: ExportConfig | DictConfig) -> None:
    """Rules that span fields or groups; each failure says what is allowed instead."""
    from exporters.program.backends import PARTITIONERS
    from exporters.program.methods import METHOD_KINDS
    from exporters.quant.schemes import DTYPES, EMBEDDING_SCHEMES, LINEAR_SCHEMES, QPARAMS
    from models.decoder import ATTENTION
    from models.families import FAMILIES
    from models.sources import SOURCES

    def one_of(what: str, value: Any, allowed: Any, fix: str) -> None:
        if value not in allowed:
            raise UserError(f"{what}={value!r} is not known. Allowed: {_names(allowed)}. {fix}")

    q, b, ex = cfg.quant, cfg.backend, cfg.export
    one_of("model.source", cfg.model.source, sorted(SOURCES), "Fix the model option file.")
    if cfg.model.family is not None:
        one_of("model.family", cfg.model.family, sorted(FAMILIES), "Or use model=hf to take it from config.json.")
    one_of("backend.partitioner", b.partitioner, sorted(PARTITIONERS), "Fix the backend option file.")
    one_of("backend.attention", b.attention, sorted(ATTENTION), "Fix the backend option file.")
    one_of("quant.dtype", q.dtype, list(DTYPES), "Pick another quant option or override quant.dtype.")
    for role, value, table in (("linear", q.linear, LINEAR_SCHEMES), ("lm_head", q.lm_head, LINEAR_SCHEMES),
                               ("embedding", q.embedding, EMBEDDING_SCHEMES)):
        if value is not None:
            one_of(f"quant.{role}", value, [None, *sorted(table)], f"Set quant.{role} to one of those.")
    one_of("export.tied_embedding", ex.tied_embedding, ["shared", "copied"], "Set it to one of those.")
    for method in ex.methods:
        one_of("export.methods entry", method, sorted(METHOD_KINDS), "Fix export.methods.")
    if not ex.methods:
        raise UserError("export.methods is empty: give at least one of " + ", ".join(sorted(METHOD_KINDS)) + ".")
    if ex.max_seq_len < 2:
        raise UserError(f"export.max_seq_len={ex.max_seq_len} is too small: use 2 or more.")
    v = cfg.validation
    if v.prompt_tokens < 1:
        raise UserError(f"validation.prompt_tokens={v.prompt_tokens}: use 1 or more (at most half of export.max_seq_len is used).")
    if v.max_tokens < 8:
        raise UserError(f"validation.max_tokens={v.max_tokens} is too few to measure anything: use 8 or more.")
    for name in ("prompt_tokens", "steps", "repeats"):
        if getattr(cfg.benchmark, name) < 1:
            raise UserError(f"benchmark.{name}={getattr(cfg.benchmark, name)}: use 1 or more.")
    if cfg.bench and not b.runs_here:
        raise UserError(
            f"bench=true: backend={b.name}'s delegate cannot run on this host, so its speed cannot be measured "
            "here. Set bench=false, or run the bench on a device with that backend."
        )
    from exporters.sweeps.summary import JobRow

    numeric = [f for f, t in JobRow.__annotations__.items() if "float" in str(t)]
    one_of("search.objective", cfg.search.objective, numeric, "Pick a numeric column of the sweep summary.")
    one_of("quant.qparams", q.qparams, sorted(QPARAMS), "Set quant.qparams to one of those.")
    if cfg.validate and v.text_file is not None:
        from exporters.runtime.quality import read_text

        read_text(v.text_file)  # a missing or empty file fails now, before any work
    for name in ("group_size", "lm_head_group_size", "embedding_group_size"):
        if getattr(q, name) < 0:
            raise UserError(f"quant.{name}={getattr(q, name)}: use 0 (per channel) or a positive group size.")
    check_backend_supports(cfg)
    from exporters.program.layouts import check_layout

    check_layout(ex.layout, ex.methods, b.dynamic_shapes)
    if not b.dynamic_shapes and not (1 <= ex.prefill_chunk < ex.max_seq_len):
        raise UserError(
            f"export.prefill_chunk={ex.prefill_chunk} must be between 1 and export.max_seq_len - 1 "
            f"({ex.max_seq_len - 1})."
        )


def check_backend_supports(cfg: ExportConfig | DictConfig) -> None:
    """Refuse a quant/backend pair the backend's kernels cannot execute, listing what would work."""
    q, b = cfg.quant, cfg.backend
    wanted = (("dtype", q.dtype, b.supported_dtypes), ("linear", q.linear, b.supported_linear),
              ("lm_head", q.lm_head, b.supported_linear), ("embedding", q.embedding, b.supported_embedding))
    for role, value, supported in wanted:
        if value not in supported:
            raise UserError(
                f"quant={q.name} asks for {role} {value or 'none'}, which backend={b.name} cannot run. "
                f"backend={b.name} supports dtypes {_names(b.supported_dtypes)}; linear/lm_head schemes "
                f"{_names(b.supported_linear)}; embedding schemes {_names(b.supported_embedding)}. "
                f"Pick another quant or backend, or override quant.{role}."
            )


def to_typed(cfg: DictConfig) -> ExportConfig:
    """The composed config as a plain, validated ``ExportConfig`` instance."""
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, ExportConfig)
    check_config(typed)
    return typed
