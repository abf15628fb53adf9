"""Structured-config schema for ``conf/``: every group option is checked against these dataclasses.

Hydra merges the YAML files onto ``ExportConfig``, so a misspelt field or a wrong type fails at
composition with a message naming the field. Cross-field rules (is this quant usable on this
backend?) are checked in :func:`check_config` with the allowed alternatives spelled out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from exporters.errors import UserError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


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


@dataclass
class ModelConfig:
    name: str = MISSING
    # Which loader builds the checkpoint directory: "hf" reads model.checkpoint, "tiny" writes a
    # deterministic tiny Llama checkpoint (with tokenizer) into the run folder first.
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
    # Linear-layer scheme (a key of exporters.quantization.LINEAR_SCHEMES), or null for none.
    linear: Optional[str] = None
    # Elements per quantization group along the input dimension; 0 = one scale per output channel.
    group_size: int = 32
    # Largest allowed |runtime - eager| / max|eager| over validated logits, and the share of
    # validated steps whose greedy token must agree.
    max_rel_error: float = 1e-4
    min_token_agreement: float = 1.0


@dataclass
class BackendConfig:
    name: str = MISSING
    # Key of exporters.backends.PARTITIONERS.
    partitioner: str = MISSING
    # Whether prefill/forward get a dynamic token dimension (else a fixed export.prefill_chunk).
    dynamic_shapes: bool = True
    # Linear quant schemes this backend can execute (null = no linear quantization).
    supported_linear: List[Optional[str]] = field(default_factory=lambda: [None])


@dataclass
class ExportSection:
    # Longest sequence (prompt + generated) the program accepts; also the KV-cache length.
    max_seq_len: int = 128
    # Methods to capture, each a key of exporters.methods.METHOD_KINDS.
    methods: List[str] = field(default_factory=lambda: ["prefill", "decode"])
    # Token count of prefill on static-shape backends.
    prefill_chunk: int = 32
    output_name: str = "model.pte"
    # Where to write; null = the Hydra run folder.
    output_dir: Optional[str] = None


@dataclass
class ValidationConfig:
    prompt: str = "Once upon a time there was a small language model"
    decode_steps: int = 8


@dataclass
class ExportConfig:
    model: ModelConfig = MISSING
    quant: QuantConfig = MISSING
    backend: BackendConfig = MISSING
    export: ExportSection = field(default_factory=ExportSection)
    validate: bool = True
    validation: ValidationConfig = field(default_factory=ValidationConfig)


def register_configs() -> None:
    """Make the schema known to Hydra; ``conf/config.yaml`` lists it first in its defaults."""
    ConfigStore.instance().store(name="export_schema", node=ExportConfig)


register_configs()


def check_config(cfg: ExportConfig | DictConfig) -> None:
    """Rules that span fields or groups; each failure says what is allowed instead."""
    from exporters.backends import PARTITIONERS
    from exporters.methods import METHOD_KINDS
    from exporters.quantization import LINEAR_SCHEMES
    from models.sources import SOURCES

    def one_of(what: str, value: Any, allowed: Any, fix: str) -> None:
        if value not in allowed:
            raise UserError(f"{what}={value!r} is not known. Allowed: {', '.join(map(str, allowed))}. {fix}")

    one_of("model.source", cfg.model.source, sorted(SOURCES), "Fix the model option file.")
    one_of("backend.partitioner", cfg.backend.partitioner, sorted(PARTITIONERS), "Fix the backend option file.")
    if cfg.quant.linear is not None:
        one_of("quant.linear", cfg.quant.linear, sorted(LINEAR_SCHEMES), "Pick another quant option.")
    for method in cfg.export.methods:
        one_of("export.methods entry", method, sorted(METHOD_KINDS), "Fix export.methods.")
    if not cfg.export.methods:
        raise UserError("export.methods is empty: give at least one of " + ", ".join(sorted(METHOD_KINDS)) + ".")
    if cfg.export.max_seq_len < 2:
        raise UserError(f"export.max_seq_len={cfg.export.max_seq_len} is too small: use 2 or more.")
    if not 0 <= cfg.validation.decode_steps < cfg.export.max_seq_len - 1:
        raise UserError(
            f"validation.decode_steps={cfg.validation.decode_steps} must be between 0 and export.max_seq_len - 2 "
            f"({cfg.export.max_seq_len - 2}) so the prompt and the steps fit in the context."
        )
    if cfg.quant.group_size < 0:
        raise UserError(f"quant.group_size={cfg.quant.group_size}: use 0 (per channel) or a positive group size.")
    if cfg.quant.linear not in cfg.backend.supported_linear:
        pairs = ", ".join("none" if s is None else s for s in cfg.backend.supported_linear)
        raise UserError(
            f"quant={cfg.quant.name} (linear scheme {cfg.quant.linear}) cannot run on backend={cfg.backend.name}: "
            f"that backend has no kernels for it. Linear schemes backend={cfg.backend.name} supports: {pairs}. "
            "Pick another quant or backend (e.g. backend=xnnpack quant=8da4w)."
        )
    if not cfg.backend.dynamic_shapes and not (1 <= cfg.export.prefill_chunk < cfg.export.max_seq_len):
        raise UserError(
            f"export.prefill_chunk={cfg.export.prefill_chunk} must be between 1 and export.max_seq_len - 1 "
            f"({cfg.export.max_seq_len - 1})."
        )


def to_typed(cfg: DictConfig) -> ExportConfig:
    """The composed config as a plain, validated ``ExportConfig`` instance."""
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, ExportConfig)
    check_config(typed)
    return typed
