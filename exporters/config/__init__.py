"""The schema of ``conf/``: every group option and override is checked against these dataclasses.

Hydra merges the YAML files onto :class:`ExportConfig`, so a misspelt field, a wrong type or a value outside
a closed set (:class:`Choice`) fails at composition with a message naming the field. Keys added with ``+``
bypass that check; :func:`to_typed` refuses them. Rules that span fields or need a registry (is this quant
usable on this backend? is this a known family?) are checked by the module that owns each registry, all
called from :func:`exporters.export.check_config` before any work.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from exporters.compat import RENAMED_KEYS
from exporters.errors import UserError
from exporters.config.resolvers import RESOLVERS

# The config groups: inside the installed package (a wheel), else conf/ at the top of the checkout.
_PACKAGE = Path(__file__).resolve().parent.parent  # exporters/
CONF_DIR = next(p for p in (_PACKAGE / "conf", _PACKAGE.parent / "conf") if (p / "config.yaml").is_file())


class Choice(str, Enum):
    """A closed set of config values. Hydra refuses any other value at composition, listing these; the member
    compares, hashes, formats and serializes as its string, so ``DTYPES[cfg.quant.dtype]`` and JSON just work."""

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Source(Choice):
    """Which loader builds the checkpoint folder (``models.sources``)."""

    hf = "hf"  # model.checkpoint: a Hugging Face folder or a GGUF file
    tiny = "tiny"  # a deterministic tiny checkpoint of model.family, written into the run folder


class DType(Choice):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[self.value])


class Algorithm(Choice):
    """How integer codes and scales are chosen (``exporters.quant``): from the weights alone (half-quadratic scale
    only, as ExecuTorch's export_llm; or min/max), or calibrated on a text (GPTQ's error compensation)."""

    hqq = "hqq"
    affine = "affine"
    gptq = "gptq"
    signround = "signround"
    distill = "distill"

    @property
    def torchao_name(self) -> str | None:
        """A data-free algorithm's value of torchao's ``IntxChooseQParamsAlgorithm``; None for a calibrated one."""
        return {"hqq": "hqq_scale_only", "affine": "affine"}.get(self.value)

    @property
    def data_free(self) -> bool:
        return self.torchao_name is not None


class RotationKind(Choice):
    """How a model is rotated before it is quantized (``exporters.quant.rotation``)."""

    none = "none"
    hadamard = "hadamard"  # randomized Hadamard rotations of the residual stream (R1) and of each head (R2), fused
    learned = "learned"  # R1 and R2 started there and learned on the calibration text (exporters.quant.learned_rotation)


class Pt2eQuantizer(Choice):
    """A backend's own PT2E quantizer (``exporters.quant.pt2e.PT2E_QUANTIZERS``), named as ExecuTorch's export_llm
    names them (``quantization.pt2e_quantize``): <backend>_<activations>_<weights>."""

    xnnpack_dynamic = "xnnpack_dynamic"  # int8 per-token dynamic activations, int8 per-channel weights
    xnnpack_dynamic_qc4 = "xnnpack_dynamic_qc4"  # the same with int4 per-channel weights
    xnnpack_static = "xnnpack_static"  # int8 activations with scales calibrated on text, int8 per-channel weights
    coreml_8a_c8w = "coreml_8a_c8w"  # coremltools: uint8 calibrated activations, int8 per-channel weights
    coreml_8a_c4w = "coreml_8a_c4w"  # the same with int4 per-channel weights
    coreml_c4w = "coreml_c4w"  # int4 per-channel weights only
    vulkan_8w = "vulkan_8w"  # int8 per-channel weights only


class Attention(Choice):
    """``models.decoder.ATTENTION``: ExecuTorch's LLM CPU kernels (runtimes must link them), or plain ATen ops."""

    aten = "aten"
    custom_ops = "custom_ops"


class KvDType(Choice):
    """What the KV cache stores (``models.decoder.KV_CACHES``)."""

    fp32 = "fp32"
    int8 = "int8"  # codes with an fp32 scale and int8 zero point per token and head: 0.27x the bytes at head_dim 64


def exhaustive(choice: type[Choice], registry: Any, where: str) -> None:
    """A registry keyed by a closed set has exactly its members (checked at import: a value added to one and not
    the other is a programming error, found before any config is composed)."""
    keys, members = {str(k) for k in registry}, {str(m) for m in choice}
    if keys != members:
        raise AssertionError(f"{where} and {choice.__name__} differ: {sorted(keys ^ members)}")


class LayoutName(Choice):
    """How methods are named (``exporters.program.layouts``)."""

    stock = "stock"
    split = "split"


class WeightsPlacement(Choice):
    """Where the weights are written (``exporters.program.weights``): inside the program, or in a ``.ptd`` beside it."""

    program = "program"
    external = "external"


class AdapterMode(Choice):
    """How ``model.adapters`` become part of the program (``exporters.program.swappable``)."""

    methods = "methods"  # each adapter gets the base's methods of its own: <adapter>_prefill, ...
    swappable = "swappable"  # the base's methods read LoRA slots an app fills at run time (set_adapter)


class TiedEmbeddingStorage(Choice):
    """A tied, unquantized embedding / lm_head matrix: stored once, or copied for lm_head (``exporters.quant.tied``)."""

    shared = "shared"
    copied = "copied"


@dataclass
class ArchOverrides:
    """The config.json field of this name, set over the checkpoint's; null: the checkpoint's own."""

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
    # Each layer's kind, one per layer: sliding_attention / full_attention (Gemma, Qwen), conv (LFM2),
    # linear_attention (Qwen3.5).
    layer_types: Optional[list[str]] = None


@dataclass
class ModelConfig:
    # The option's name (conf/model/<name>.yaml), used in run folder names and sweep summaries.
    name: str = MISSING
    # Model family (a key of models.families.FAMILIES): the checkpoint must be of this family, and
    # random_init without a checkpoint builds one. null = take the family from config.json.
    family: Optional[str] = None
    # Which loader builds the checkpoint directory: "hf" reads model.checkpoint, "tiny" writes a
    # deterministic tiny checkpoint of model.family (with tokenizer) into the run folder first.
    source: Source = Source.hf
    # A Hugging Face checkpoint folder or a GGUF file (model.source=hf).
    checkpoint: Optional[str] = None
    # Build the architecture with seeded random weights (benchmarks, size studies): needs config.json
    # from model.checkpoint, or every field of model.arch.
    random_init: bool = False
    # Seed of random weights and of the tiny model's training.
    seed: int = 0
    # Architecture fields set over config.json's (or, with random_init and no checkpoint, the whole architecture).
    arch: ArchOverrides = field(default_factory=ArchOverrides)
    # The side S of the one square image a vision-language program takes, for Qwen2.5-VL, Qwen3-VL, Qwen3.5 and Gemma 4,
    # whose processors take any size in a range: a multiple of the patch size x 2 (28 or 32; Gemma 4: x 3, 48); the
    # run's processor files are written with it. null = the processor's, when it fixes one square (448 for a
    # random-weight Qwen shape; Gemma 4: the largest square within its token budget, 768 at 280). Other families'
    # processors fix it (a different value is refused).
    image_size: Optional[int] = None
    # LoRA adapters as PEFT saves them (a folder with adapter_config.json + adapter_model.safetensors), by name:
    # "+model.adapters={chat: /path/a, summary: /path/b}" (with +: no model option lists adapters). Each adds the base's methods with the adapter applied,
    # named <name>_<method> (chat_prefill, chat_decode_one_token, ...), over the same stored base weights.
    adapters: Dict[str, str] = field(default_factory=dict)


@dataclass
class CalibrationConfig:
    # The text calibrated algorithms (quant.algorithm=gptq) learn the model's activations from: plain UTF-8
    # text like what the model will see; null = the English text shipped in exporters/data/calibration_text.txt,
    # written apart from the validation text so quality is never measured on text calibration saw.
    text_file: Optional[str] = None
    # Tokens of the text used at most (more is slower to calibrate, rarely better past a few thousand).
    max_tokens: int = 4096


@dataclass
class LearningConfig:
    # The learned algorithms' steps (one calibration window a step) and step size, decayed to zero: with
    # quant.algorithm=distill, Adam steps of the whole model's group scales (null = 60) and the step on their log
    # (null = 0.001); with signround, each decoder layer's signed-gradient steps (null = 50) and their size (null =
    # 1/steps, as the SignRound paper). More steps cost time linearly (docs/quality.md#learned-4-bit); other
    # algorithms learn nothing and refuse these.
    steps: Optional[int] = None
    lr: Optional[float] = None
    # signround: learn each weight's rounding too (offsets in [-0.5, 0.5]): a parameter per weight, which fits a
    # few thousand calibration tokens and loses on other text (measured on SmolLM2-135M), so off by default.
    rounding: bool = False


@dataclass
class QuantConfig:
    # The option's name (conf/quant/<name>.yaml), used in run folder names and sweep summaries.
    name: str = MISSING
    # Dtype of weights and activations left in floating point.
    dtype: DType = DType.fp32
    # Scheme of the linear layers (a key of exporters.quant.schemes.LINEAR_SCHEMES), or null for none.
    linear: Optional[str] = None
    # Elements per quantization group along the input dimension; 0 = one scale per output channel.
    group_size: int = 32
    # The output projection may use its own scheme; by default it follows the linear layers.
    lm_head: Optional[str] = "${.linear}"
    lm_head_group_size: int = "${.group_size}"  # type: ignore[assignment]
    # Scheme of the token embedding (a key of exporters.quant.schemes.EMBEDDING_SCHEMES), or null.
    embedding: Optional[str] = None
    # Elements per group of the embedding's scheme; 0 = one scale per row.
    embedding_group_size: int = 32
    # Scheme of LoRA adapters' A and B matrices (model.adapters), a key of LINEAR_SCHEMES, or null: kept in
    # the model's dtype (fp32 beside an 8da4w base). 8da8w stores them in 8 bits, one scale per row. With
    # export.adapters=swappable only 8w: set_adapter and adapter files take the matrices in 8 bits, a scale per row.
    adapters: Optional[str] = None
    # How the linear layers' (and lm_head's) integer codes and scales are chosen: "hqq" as ExecuTorch's export_llm
    # does, "affine" (min/max), "gptq": calibrated on quant.calibration's text (each column's rounding error
    # compensated by the columns not yet rounded), "distill": GPTQ's codes, then every group scale learned at once
    # against the unquantized model's predictions on that text (quant.learning; a few minutes more), or "signround"
    # (experimental): each decoder layer's group scales learned against the unquantized layer's output, q/k/v and
    # lm_head by GPTQ. All in the same format and size (docs/quality.md#learned-4-bit).
    algorithm: Algorithm = Algorithm.hqq
    # The token embedding is a lookup (it has no inputs to calibrate with): "hqq" or "affine".
    embedding_algorithm: Algorithm = Algorithm.hqq
    # The text calibrated algorithms and static activation scales learn from.
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    learning: LearningConfig = field(default_factory=LearningConfig)
    # Rotate the model before quantizing it, so a few outlier channels no longer set every group's scale
    # (QuaRot, SpinQuant; docs/quality.md#rotations): "hadamard" fuses a randomized Hadamard rotation of the
    # residual stream (R1, RMSNorm gains folded into the next linears) and of each head's values (R2) into the
    # weights, at no run-time cost (a tied embedding stays one matrix: two small matrices then run at run time).
    # In fp32 the rotated model computes what the plain one does. With data-free rounding (hqq, affine) residual
    # channels with massive activations on the calibration text stay unrotated. "none": the checkpoint's weights.
    rotation: RotationKind = RotationKind.none
    # R4: a Hadamard transform of down_proj's input computed at run time (the SwiGLU product carries the worst
    # outliers and no weight before it can absorb a rotation), down_proj's weights turned to match; a few small
    # matmuls per layer and token (exporters.quant.hadamard).
    online_hadamard: bool = False
    # Seed of the rotations' random signs: another seed is another rotation, of the same quality on average.
    rotation_seed: int = 0
    # The Cayley SGD steps of quant.rotation=learned (experimental), one calibration window each, from the Hadamard
    # rotations toward the unquantized model's predictions through the 4-bit rounded one (null = 24; time grows
    # linearly).
    rotation_steps: Optional[int] = None
    # Mixed precision: let the weights grow to this multiple of the uniform scheme's size (e.g. 1.05), spent on
    # 8 bits for the 4-bit linears (and lm_head) whose rounding costs the most KL per byte, measured on the
    # calibration text (exporters.quant.mixed). null: every layer gets the scheme above.
    size_budget: Optional[float] = None
    # Quantize the linear layers with a backend's own quantizer on the captured graph (PT2E: prepare, calibrate
    # on quant.calibration's text when activations get static scales, convert), instead of torchao's source
    # transforms (quant.linear must then be null). One of Pt2eQuantizer, for the backend it names; conf/quant/pt2e_*.
    pt2e: Optional[Pt2eQuantizer] = None
    # A vision-language checkpoint's vision encoder (tower and projector): its own scheme, whatever the text
    # decoder's; validated against its own eager model (exporters.program.vision). "auto": 8da8w beside a quantized
    # decoder (half the encoder's bytes and image encode time, docs/vision.md), fp32 beside a float one.
    vision: str = "auto"  # "auto" or one of exporters.program.vision.VISION_SCHEMES
    # A speech checkpoint's audio encoder (Whisper's encoder): its own scheme, whatever the text decoder's
    # (exporters.components.speech). "auto": 8da8w beside a quantized decoder, fp32 beside a float one.
    audio: str = "auto"  # "auto" or one of exporters.quant.vision.VISION_SCHEMES (the same encoder schemes)
    # Static int8 activations (pt2e_xnnpack_static, pt2e_coreml_8a_*) are refused unless this is true: one scale per
    # tensor is set by the first token's massive activation, and SmolLM2-135M loses +831% perplexity (+165%
    # rotated; docs/quality.md#pt2e-the-backends-own-quantizers). true: export it anyway, to study it or as QAT's start.
    allow_static_activations: bool = False
    # Validation tolerances of the program against the eager model quantized the same way (not against the
    # unquantized baseline), on the validation text; calibrated on SmolLM2-135M (docs/quality.md):
    # mean KL(eager || program) per predicted token in nats, the share of positions whose greedy token
    # agrees, and the allowed relative drift of the program's perplexity above the eager model's.
    max_kl: float = 1e-3
    min_top1: float = 0.95
    max_ppl_drift: float = 0.01


@dataclass
class BackendConfig:
    # The option's name (conf/backend/<name>.yaml), used in run folder names and sweep summaries.
    name: str = MISSING
    # Key of exporters.backends.BACKENDS; `options` are passed to it.
    partitioner: str = MISSING
    # The partitioner's own settings (a free dict: the one place extra keys belong).
    options: Dict[str, Any] = field(default_factory=dict)
    # Whether prefill/forward get a dynamic token dimension (else a fixed export.prefill_chunk).
    dynamic_shapes: bool = True
    # Attention implementation: "custom_ops" uses ExecuTorch's LLM CPU kernels (runtimes must link them),
    # "aten" plain ops any delegate can take.
    attention: Attention = Attention.aten
    # Whether this machine's ExecuTorch runtime can execute the delegate (else validation runs the
    # captured programs before delegation, and the manifest says so).
    runs_here: bool = True
    # What the backend's kernels can execute; anything else is refused at config time.
    supported_dtypes: List[DType] = field(default_factory=lambda: [DType.fp32])
    supported_linear: List[Optional[str]] = field(default_factory=lambda: [None])
    supported_embedding: List[Optional[str]] = field(default_factory=lambda: [None])
    # Where this backend's weights can be written (export.weights): "external" needs a delegate that hands its
    # weights to ExecuTorch's named data store (XNNPACK), or none (portable).
    supported_weights: List[WeightsPlacement] = field(default_factory=lambda: [WeightsPlacement.program])
    # With export.weights=external, each LoRA adapter's weights can go to a data file of its own: needs a delegate
    # that names its weights (XNNPACK); without one, ExecuTorch folds each method's constants under per-method names.
    adapter_data_files: bool = True


@dataclass
class ExportSection:
    # Most tokens one call of the prompt method takes (a longer prompt is fed in calls of this size; the stock
    # runner reads it as get_max_seq_len), and the KV-cache length unless max_context_len is set.
    max_seq_len: int = 128
    # KV-cache positions: the longest conversation (prompt + generated) the program holds (get_max_context_len).
    # null = max_seq_len. A long context with a short max_seq_len keeps prefill's dynamic shapes small.
    max_context_len: Optional[int] = None
    # What the KV cache stores: fp32, or int8 with a scale per token and head (ExecuTorch's
    # llama::custom_quantized_sdpa; backends with attention: custom_ops). Validated against the same model with an
    # fp32 cache, within validation.int8_kv's tolerances.
    kv_dtype: KvDType = KvDType.fp32
    # Attention sink: keep the first this many positions in the cache forever and ring the rest, so a conversation
    # goes on past max_context_len (each layer then attends to the sink and the last max_context_len - sink
    # positions; StreamingLLM). 0 = off: generation stops at the end of the cache.
    attention_sink: int = 0
    # Methods to capture, each a key of exporters.program.methods.METHOD_KINDS: prefill (a prompt), decode (one
    # token), forward (what the stock runners call), verify (speculative decoding's check of draft.tokens proposals).
    # These are kinds; export.layout names them in the program (stock: decode is decode_one_token; split: decode).
    methods: List[str] = field(default_factory=lambda: ["prefill", "decode", "forward"])
    # How the methods are named (a key of exporters.program.layouts.LAYOUTS): "stock" runs correctly in every
    # ExecuTorch stock runner we test; "split" uses the prefill/decode names, which ExecuTorch 1.5.1's
    # stock runner runs with two KV caches (wrong text): only for apps that share memory arenas.
    layout: LayoutName = LayoutName.stock
    # A tied, unquantized embedding/lm_head matrix: "shared" stores it once (lm_head reads the embedding's
    # copy; on XNNPACK it is then repacked at every call), "copied" lets the backend keep its own packed copy
    # for lm_head: faster decode, larger file (measured in docs/DESIGN.md).
    tied_embedding: TiedEmbeddingStorage = TiedEmbeddingStorage.shared
    # Where the weights go: "program" writes one self-contained .pte; "external" writes the weights to a .ptd
    # data file beside it (model.pte + model.ptd), which runtimes load together; the .pte is then the same
    # bytes for any weights of these shapes (docs/runners.md).
    weights: WeightsPlacement = WeightsPlacement.program
    # The most memory (GB) this export may need: before reading any weight, its peak RSS is estimated from the
    # architecture and quant (exporters/plan/footprint.py) and the export refused above this. null = the memory this
    # machine has available when the export starts.
    memory_limit_gb: Optional[float] = None
    # Shortcuts through private ExecuTorch and torchao internals (exporters/program/internals.py) in quantize, lower and
    # emit: faster and leaner, the same program bytes. false: the libraries' stock path. With versions other than
    # the checked ones (exporters/program/versions.py) the stock path is taken anyway, with a warning.
    shortcuts: bool = True
    # Token count of prefill on static-shape backends.
    prefill_chunk: int = 32
    # How model.adapters become part of the program: "methods" gives each adapter the base's methods of its own
    # (<adapter>_prefill, ...), validated per adapter; "swappable" gives the base's methods LoRA slots that the app
    # fills at run time with the set_adapter method (any PEFT adapter whose targets and ranks fit, trained before or
    # after the export), and writes each adapter given as adapters/<name>.ptd (docs/adapters.md).
    adapters: AdapterMode = AdapterMode.methods
    # Swappable slots: the largest rank an adapter may have, and the kinds of linear layer that take one (q_proj,
    # v_proj, ...); null = those of model.adapters (both are needed when model.adapters is empty).
    lora_max_rank: Optional[int] = None
    lora_targets: Optional[List[str]] = None
    # The program's file name in the run folder (a .ptd beside it takes the same stem).
    output_name: str = "model.pte"
    # Where to write; null = the Hydra run folder.
    output_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if self.max_seq_len < 2:
            raise UserError(f"export.max_seq_len={self.max_seq_len} is too small: use 2 or more.")


@dataclass
class DraftConfig:
    # A smaller model with the target's tokenizer (a Hugging Face folder or a GGUF file) whose methods draft_prefill
    # and draft_decode_one_token go into the program beside the target's, with a KV cache of their own; the target
    # then gets verify too. null = no draft (export.methods may still have verify: prompt-lookup speculation).
    checkpoint: Optional[str] = None
    # Tokens proposed per speculative step (K): the verify method (export.methods) takes the last accepted token and
    # K proposed ones in one call, and returns the logits of every position (docs/speculative.md).
    tokens: int = 4
    # How the draft is quantized: a preset of conf/quant (draft.quant=8da8w), its tolerances included; null = the
    # target's quant.
    quant: Optional[str] = None
    # FR-Spec: the draft proposes among this many of the most frequent tokens only (its lm_head keeps their rows, so a
    # proposal computes that share of the head; the tokenizer's special tokens are always among them). null = all.
    vocab: Optional[int] = None
    # What ranks the tokens for draft.vocab: a UTF-8 text (your app's kind of text) whose token counts rank them, ties
    # and unseen tokens by the tokenizer's order; null = that order alone (BPE merges the most frequent pairs first).
    vocab_text: Optional[str] = None

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise UserError(f"draft.tokens={self.tokens}: a speculative step proposes at least 1 token.")


@dataclass
class KvCacheTolerance:
    # What a quantized KV cache (export.kv_dtype=int8) may add to quant's tolerances, validation comparing the
    # program with the same model keeping an fp32 cache. Measured on SmolLM2-135M, int8 against fp32 cache, eager:
    # KL 5e-4, top-1 98.6%, perplexity +0.1% (2048-token context, docs/long_context.md).
    max_kl: float = 5e-3
    min_top1: float = 0.97
    max_ppl_drift: float = 0.01


@dataclass
class ValidationConfig:
    # A UTF-8 text to score (a few paragraphs); null = the English text shipped in exporters/data/.
    text_file: Optional[str] = None
    # A speech program's recording to transcribe (WAV, FLAC, ...); null = the sentence shipped in exporters/data/.
    audio_file: Optional[str] = None
    # Tokens of each window fed through the prompt method (prefill) at once, at most half the context;
    # the rest go through decode.
    prompt_tokens: int = 32
    # Tokens of the text scored at most (bounds the time validation takes).
    max_tokens: int = 256
    # Warn when the program's perplexity exceeds the unquantized model's by more than this share (0.2 = +20%),
    # and measure which change of the quant config wins most of it back per MB (exporters/quant/advice.py:
    # about one quantize stage per remedy). null: no warning.
    warn_ppl_increase: Optional[float] = 0.2
    # Added to quant's tolerances when the KV cache is quantized (export.kv_dtype).
    int8_kv: KvCacheTolerance = field(default_factory=KvCacheTolerance)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise UserError(f"validation.prompt_tokens={self.prompt_tokens}: use 1 or more (at most half of "
                            "the cache, export.max_context_len, is used).")
        if self.max_tokens < 8:
            raise UserError(f"validation.max_tokens={self.max_tokens} is too few to measure anything: use 8 or more.")
        if self.warn_ppl_increase is not None and self.warn_ppl_increase < 0:
            raise UserError(f"validation.warn_ppl_increase={self.warn_ppl_increase}: give the share of perplexity "
                            "increase to warn above (0.2 = +20%), or null for no warning.")


@dataclass
class BenchmarkConfig:
    # Runtime speed of the written program (the bench stage): a prompt of prompt_tokens through the prompt
    # method, then steps greedy tokens one at a time; medians over repeats after one warm-up round.
    # Both are cut to fit export.max_seq_len (at most half of it for the prompt).
    prompt_tokens: int = 64
    steps: int = 64
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise UserError(f"benchmark.{name}={getattr(self, name)}: use 1 or more.")


@dataclass
class SearchConfig:
    # The trial objective of an Optuna search (--config-name search): a numeric column of the sweep
    # summary (exporters.sweeps.summary.JobRow), e.g. size_mb, decode_tok_s, ppl_increase; the sweeper's
    # direction says whether it is minimized or maximized.
    objective: str = "size_mb"
    # Trials whose perplexity increase over the unquantized baseline is above this are infeasible (scored
    # inf); null = no bound.
    max_ppl_increase: Optional[float] = None


@dataclass
class SweepConfig:
    # Memory one export job needs, in GB (SmolLM2-135M about 3, a 1B model about 10: the peak RSS column
    # of a sweep summary): the local_parallel launcher runs as many jobs at once as fit in memory.
    job_memory_gb: int = 4


@dataclass
class ExportConfig:
    # Which checkpoint, its family and architecture, its adapters (the model group: conf/model).
    model: ModelConfig = MISSING
    # Dtype, schemes per layer role, algorithm, validation tolerances (the quant group: conf/quant).
    quant: QuantConfig = MISSING
    # Partitioner, shapes, attention kernels and what its kernels run (the backend group: conf/backend).
    backend: BackendConfig = MISSING
    # Lengths, methods and their names, cache, where the weights and the program are written.
    export: ExportSection = field(default_factory=ExportSection)
    # Speculative decoding: a draft model, how many tokens a step proposes for verify to check, the draft's quant.
    draft: DraftConfig = field(default_factory=DraftConfig)
    # Run the program in the ExecuTorch runtime against the eager model before calling it good (false: skip).
    validate: bool = True
    # The validation text and its windows, the quality warning, the int8 cache's tolerance.
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    # Measure the program's speed and memory in the runtime after writing it (manifest "bench").
    # null = on in sweeps (-m), off for a single export.
    bench: Optional[bool] = None
    # How the bench stage measures: prompt length, decode steps, repeats.
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    # Settings of sweeps (-m): memory per job for the local parallel launcher.
    sweep: SweepConfig = field(default_factory=SweepConfig)
    # The objective and bound of an Optuna search (--config-name search).
    search: SearchConfig = field(default_factory=SearchConfig)
    # Show library warnings, library logging and the ExecuTorch runtime's own output on the console.
    verbose: bool = False


def register_configs() -> None:
    """Make the schema known to Hydra (``conf/config.yaml`` lists it first in its defaults), and the resolvers
    the launcher presets use. The commands call it before Hydra composes; calling it again changes nothing."""
    ConfigStore.instance().store(name="export_schema", node=ExportConfig)
    for name, resolver in RESOLVERS.items():
        OmegaConf.register_new_resolver(name, resolver, replace=True)


def compose(*overrides: str, config_name: str = "config", return_hydra_config: bool = False) -> DictConfig:
    """The config ``python -m exporters.llm <overrides>`` runs with: the real ``conf/`` tree, composed by Hydra
    (for the library call ``exporters.export.export``, tests and benchmarks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides),
                             return_hydra_config=return_hydra_config)


def quant_option(name: str, where: str = "quant") -> "QuantConfig":
    """The option ``conf/quant/<name>.yaml`` typed, as ``quant=<name>`` composes it (its defaults list names options
    of the same group, merged first), without composing a whole config: the draft's quant (``draft.quant``), another
    option's calibrated tolerances. ``where``: the key that named it, for the error."""
    folder = CONF_DIR / "quant"
    presets = sorted(p.stem for p in folder.glob("*.yaml"))
    if name not in presets:
        raise UserError(f"{where}={name} is not a preset of conf/quant: use one of {', '.join(presets)}, or null for "
                        "the target's quant.")

    def node(preset: str) -> Any:
        raw = OmegaConf.load(folder / f"{preset}.yaml")
        bases = [node(d) for d in raw.pop("defaults", []) if d != "_self_"]
        return OmegaConf.merge(*bases, raw) if bases else raw

    typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConfig), node(name)))
    assert isinstance(typed, QuantConfig)
    return typed


def unknown_keys(cfg: DictConfig, schema: type = None, prefix: str = "") -> list[str]:  # type: ignore[assignment]
    """Keys of ``cfg`` that ``schema`` (default :class:`ExportConfig`) has no field for, as dotted paths.

    Hydra checks plain overrides against the schema, but ``+key=value`` adds a key whatever the schema says;
    ``backend.options`` (a free dict passed to the partitioner) is the one place extra keys belong.
    """
    schema = schema or ExportConfig
    hints = get_type_hints(schema)
    known = {f.name for f in fields(schema)}
    found = []
    for key in cfg.keys():
        if key == "hydra" and not prefix:
            continue
        if key not in known:
            found.append(f"{prefix}{key}")
        elif is_dataclass(hints[key]) and isinstance(cfg[key], DictConfig):
            found += unknown_keys(cfg[key], hints[key], f"{prefix}{key}.")
    return found


def _known_paths(schema: type, prefix: str = "") -> list[str]:
    hints = get_type_hints(schema)
    paths = []
    for f in fields(schema):
        paths.append(prefix + f.name)
        if is_dataclass(hints[f.name]):
            paths += _known_paths(hints[f.name], f"{prefix}{f.name}.")
    return paths


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse keys the schema does not have (however they were added), naming the closest known field."""
    unknown = unknown_keys(cfg)
    if not unknown:
        return
    known = _known_paths(ExportConfig)
    hints = []
    for key in unknown:
        if key in RENAMED_KEYS:
            hints.append(f"{key} was renamed {RENAMED_KEYS[key]}")
            continue
        section, _, leaf = key.rpartition(".")
        siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == section]
        close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.7)
        hints.append(key + (f" (did you mean {section + '.' if section else ''}{close[0]}?)" if close else ""))
    raise UserError(
        f"unknown config key(s): {'; '.join(hints)}. Nothing was exported. A `+` override adds a key the schema "
        "(exporters/config.py) does not have, and it would be ignored: fix the name, or see every field with "
        "`python -m exporters.llm --cfg job`."
    )


def to_typed(cfg: DictConfig) -> ExportConfig:
    """The composed config as a plain ``ExportConfig`` instance, after refusing keys the schema does not know."""
    check_known_keys(cfg)
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, ExportConfig)
    return typed
