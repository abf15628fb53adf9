"""What an export will hold in memory, estimated from the architecture before any weight is read.

A model that cannot fit is refused at the start with the estimate and what to change, rather than killed by the
kernel's out-of-memory killer half an hour in. The weights are counted in each form the export holds them: as stored
(the checkpoint's dtype; random weights are made in bf16), as the quantized eager model keeps them (torchao: one int8
code per weight, an fp32 scale and an int8 zero point per group), and as the program stores them (packed codes,
scales). Each stage's peak is those forms alive at once plus what the stage itself adds, measured stage by stage
(docs/DESIGN.md 10); ``benchmarks.memory_estimate`` holds the whole within 15% of the measured peak of every
benchmark preset (``tests/test_footprint.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from exporters.config import Algorithm, QuantConfig, RotationKind, TiedEmbeddingStorage
from exporters.console import count
from exporters.errors import UserError
from exporters.quant.advice import changes
from exporters.quant.distill import distill_bytes
from exporters.quant.learned_rotation import learned_rotation_bytes
from exporters.quant.mixed import Precision
from exporters.quant.rotation import rotates
from exporters.quant.schemes import DTYPES, EMBEDDING_SCHEMES, LINEAR_SCHEMES, layer_scheme
from exporters.quant.tied import TiedEmbedding, plan_tied_embedding as tie_plan
from models.decoder import CausalLM

if TYPE_CHECKING:
    from exporters.plan import Component, ExportPlan
    from models.gguf import GgufTensors

GB = 1e9
MIB = 2**20
# RSS of the exporter with torch, torchao and ExecuTorch imported, before any weight (measured: 0.4-0.5 GB).
BASE_BYTES = int(0.5 * GB)
# What each stage adds beyond the weights it holds, measured stage by stage on the 134M, SmolLM2-135M and 1B presets
# (benchmarks.profile_memory --validate; docs/DESIGN.md 10):
QUANTIZE_BASE = 100 * MIB  # torchao's quantize_ and its temporaries
LOWERED_BASE = 100 * MIB  # ExecuTorch's emit and runtime, from emit on
LOWERED_PER_LAYER = 14 * MIB  # each decoder layer's graphs, delegates and records, from lowering on
PREPROCESS_PER_VOCAB = 6.5  # bytes per vocabulary parameter while XNNPACK preprocesses (copies, repacks) its partition
EMIT_PER_VOCAB = 2.0  # bytes per vocabulary parameter while emit serializes the program
LOGITS_COPIES = 3.5  # [tokens, vocab] fp32 tensors alive at once while validation scores a text
ROTATION_COPIES = 3  # float64 copies of the largest matrix while a rotation turns it (its input, product, result)


@dataclass(frozen=True)
class Footprint:
    """Bytes of the weights in each form, and the export's estimated peak RSS and the stage it falls in."""

    parameters: int
    stored: int  # as loaded (the checkpoint's dtype)
    eager: int  # the quantized eager model
    program: int  # the program's weights
    peaks: dict[str, int]  # each stage's estimated peak RSS, from its weights on
    advise: int | None = None  # the advise stage's, if the quality warning sets it off (not refused: it may not run)
    converting: int = 0  # the peak of a GGUF file's first conversion, in load before any weight is read (0: none)

    @property
    def stages(self) -> dict[str, int]:
        """Each stage's peak, load's with the first conversion of a GGUF file."""
        return {s: max(peak, self.converting) if s == "load" else peak for s, peak in self.peaks.items()}

    @property
    def peak_stage(self) -> str:
        stages = self.stages
        return max(stages, key=stages.__getitem__)

    @property
    def peak(self) -> int:
        return self.stages[self.peak_stage]

    def beside(self, other: "Footprint") -> "Footprint":
        """This model's footprint with ``other`` held in the same export (the target and its draft: both alive from
        load to finalize, each stage working on one then the other): weights add up, and so, conservatively, do the
        stages' peaks. GGUF conversions run one after the other, before either model is loaded."""
        held = BASE_BYTES + other.eager
        return Footprint(self.parameters + other.parameters, self.stored + other.stored, self.eager + other.eager,
                         self.program + other.program,
                         {s: peak + other.peaks.get(s, held) - BASE_BYTES for s, peak in self.peaks.items()},
                         None if self.advise is None else self.advise + other.eager,
                         max(self.converting, other.converting))

    def first_converting(self, tensors: "GgufTensors") -> "Footprint":
        """This footprint with ``tensors``' GGUF file converted first (its first use)."""
        return replace(self, converting=max(self.converting, conversion_peak(tensors)))

    def describe(self) -> str:
        converting = (f", {self.converting / GB:.1f} GB converting the GGUF file first" if self.converting
                      and self.peak_stage == "load" and self.converting >= self.peaks["load"] else "")
        return (f"{count(self.parameters)} parameters: {_size(self.stored)} as stored, {_size(self.eager)} "
                f"quantized in memory, {_size(self.program)} in the program; estimated peak RSS "
                f"{self.peak / GB:.1f} GB (in {self.peak_stage}{converting})"
                + (f", {self.advise / GB:.1f} GB if the quality warning's remedies are measured (advise)"
                   if self.advise is not None and self.advise > self.peak else ""))


def conversion_peak(tensors: "GgufTensors") -> int:
    """The peak RSS of converting a GGUF file (``models.gguf``): transformers dequantizes every tensor it stores into
    an fp32 model, the largest's fp32 temporary beside it and the file's pages mapped (measured on SmolLM2-135M and
    Qwen2.5-Coder 0.5B and 1.5B: within 5%, docs/performance.md)."""
    return BASE_BYTES + 4 * tensors.parameters + 4 * tensors.largest + tensors.file_bytes


def check_conversion(tensors: "GgufTensors", limit_gb: float | None) -> None:
    """Refuse to convert a GGUF file whose conversion alone would not fit, before it starts."""
    peak, limit = conversion_peak(tensors), memory_limit(limit_gb)
    if peak <= limit:
        return
    where = f"export.memory_limit_gb={limit_gb}" if limit_gb is not None else "the memory this machine has available"
    raise UserError(
        f"{tensors.file.name} would not convert here: its first use dequantizes {count(tensors.parameters)} "
        f"parameters to fp32, about {peak / GB:.1f} GB at the peak (estimated), above {where} ({limit / GB:.1f} GB). "
        "What to change: export from the model's Hugging Face checkpoint (its safetensors load without a "
        "conversion), or a machine with more memory. If the estimate is wrong for this machine (swap, or memory "
        "freed since), set export.memory_limit_gb.")


def _size(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} KB"


def _quantized_bytes(rows: int, cols: int, scheme: str | None, group_size: int, table: dict, dtype_bytes: int,
                     ) -> tuple[int, int]:
    """(eager, program) bytes of one [rows, cols] matrix stored by ``scheme`` (None: left in the model's dtype)."""
    if scheme is None:
        return rows * cols * dtype_bytes, rows * cols * dtype_bytes
    name, group = layer_scheme(scheme, cols, group_size)
    groups = rows * (cols // group if group else 1)
    eager = rows * cols + groups * 5  # torchao: int8 codes, an fp32 scale and an int8 zero point per group
    return eager, Precision(name, table[name], group).bytes(rows, cols)


def _turning(weights: "Weights") -> int:
    """A rotation turns each matrix in float64 (exact products), the vocabulary's the largest."""
    return ROTATION_COPIES * max(weights.vocab, weights.largest_linear) * 8


@dataclass(frozen=True)
class Weights:
    """One model's weights counted in the forms an export holds them (bytes; shapes only)."""

    eager: int  # the quantized eager model
    program: int  # the program's weights
    largest_linear: int  # parameters of the largest linear that is not lm_head
    vocab: int  # parameters of one vocabulary matrix
    vocab_eager: int  # the vocabulary matrices (one if tied) as the quantized eager model holds them
    tying: TiedEmbedding  # what lm_head is, decided as exporters.quant.tied will
    # Embedding tables beside the vocabulary's (Gemma 4's per-layer table: 2.35B parameters in E2B): quantized after
    # the linears as the embedding is, each cast to fp32 whole. Their parameters, their eager bytes, the largest.
    tables: int = 0
    tables_eager: int = 0
    largest_table: int = 0

    @property
    def tied(self) -> bool:
        return self.tying in (TiedEmbedding.SHARED, TiedEmbedding.QUANTIZED_ONCE)


def count_weights(model: CausalLM, quant: QuantConfig, tied_storage: TiedEmbeddingStorage) -> Weights:
    """``model``'s weights (built on the meta device: only shapes are read) in each form, quantized by ``quant``."""
    dtype_bytes = DTYPES[quant.dtype].itemsize
    head, embed = model.lm_head, model.model.embed_tokens
    tying = tie_plan(model, quant, tied_storage)
    tied = tying in (TiedEmbedding.SHARED, TiedEmbedding.QUANTIZED_ONCE)
    eager = program = largest_linear = tables = tables_eager = largest_table = 0
    counted: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Linear) and (module is not head or not tied):
            scheme, group = ((quant.lm_head, quant.lm_head_group_size) if module is head
                             else (quant.linear, quant.group_size))
            e, p = _quantized_bytes(module.out_features, module.in_features, scheme, group, LINEAR_SCHEMES,
                                    dtype_bytes)
            if module is not head:
                largest_linear = max(largest_linear, module.weight.numel())
        elif isinstance(module, nn.Embedding):
            e, p = _quantized_bytes(module.num_embeddings, module.embedding_dim, quant.embedding,
                                    quant.embedding_group_size, EMBEDDING_SCHEMES, dtype_bytes)
            if module is not embed and id(module.weight) not in counted:
                tables, tables_eager = tables + module.weight.numel(), tables_eager + e
                largest_table = max(largest_table, module.weight.numel())
        else:
            e = p = sum(t.numel() for t in module.parameters(recurse=False) if id(t) not in counted) * dtype_bytes
        counted.update(id(t) for t in module.parameters(recurse=False))
        eager, program = eager + e, program + p
    vocab_eager = _quantized_bytes(*embed.weight.shape, quant.embedding, quant.embedding_group_size,
                                   EMBEDDING_SCHEMES, dtype_bytes)[0] * (1 if tied else 2)
    return Weights(eager, program, largest_linear, embed.weight.numel(), vocab_eager, tying, tables, tables_eager,
                   largest_table)


@dataclass(frozen=True)
class MemoryBudget:
    """What the load stage checks an export against before reading any weight."""

    quant: QuantConfig
    tied_storage: TiedEmbeddingStorage
    validation_tokens: int | None  # the tokens validation scores (validation.max_tokens); None: no validation
    limit_gb: float | None  # export.memory_limit_gb; None: the memory available when the export starts
    cast_whole: bool = False  # the model is cast whole before quantizing (exporters.plan.QuantPlan.cast_whole)
    advising: bool = False  # the advise stage runs (validation.warn_ppl_increase)
    random_init: bool = False  # the weights are made, not read (model.random_init)

    @staticmethod
    def of(plan: "ExportPlan", component: "Component | None" = None) -> "MemoryBudget":
        """What the plan's export holds for ``component`` (None: the decoder): its quantization, validation and
        (the decoder's only) advise."""
        component = plan.main if component is None else component
        quant, validation = component.quant, plan.validation
        tokens = None if validation is None else validation.config.max_tokens
        return MemoryBudget(quant.config, quant.tied_storage, tokens, plan.memory_limit_gb, cast_whole=quant.cast_whole,
                            advising=component.is_decoder and validation is not None
                            and validation.advise_threshold is not None, random_init=component.build.model.random_init)

    def estimate(self, shapes: CausalLM, stored_bytes: int) -> Footprint:
        """The footprint of exporting ``shapes`` (a model on the meta device), its weights ``stored_bytes`` as loaded.

        Each stage's peak is what it holds (the forms of the weights) plus what it adds; the added terms were
        measured stage by stage (``benchmarks.profile_memory``) and the whole is checked against the measured peak
        of every benchmark preset (``benchmarks.memory_estimate``, docs/DESIGN.md 10)."""
        weights = count_weights(shapes, self.quant, self.tied_storage)
        # From lowering on the process holds ExecuTorch's modules and, per decoder layer, its graphs, delegates and
        # their records (with the default methods).
        lowered = BASE_BYTES + LOWERED_BASE + weights.eager + len(shapes.model.layers) * LOWERED_PER_LAYER
        stored_per_parameter = stored_bytes / shapes.parameter_count()
        peaks = self._export_peaks(weights, stored_bytes, stored_per_parameter, lowered)
        calibrated = self._calibrated_quantize(shapes, weights, stored_bytes)
        if self.cast_whole:
            peaks["quantize"] = max(peaks["quantize"], BASE_BYTES + QUANTIZE_BASE + calibrated
                                    + (_turning(weights) if rotates(self.quant) else 0))
        advise = None
        if self.validation_tokens is not None:
            one = self.validation_tokens * shapes.model.embed_tokens.num_embeddings * 4
            peaks.update(self._validation_peaks(weights, stored_bytes, lowered, int(LOGITS_COPIES * one)))
            for stage in ("quantize", "lower", "emit", "validate"):  # the baseline's predictions, kept to compare with
                peaks[stage] += one
            if self.advising:
                # Each remedy advise measures is a fresh model quantized (calibrated, for GPTQ) beside the export's
                # eager model. Advise runs only past the quality warning's threshold: its peak is reported, not
                # refused.
                rotating = any(c.rotates for c in changes(self.quant))
                advise = lowered + QUANTIZE_BASE + calibrated + (_turning(weights) if rotating else 0)
        return Footprint(shapes.parameter_count(), stored_bytes, weights.eager, weights.program, peaks, advise)

    def _export_peaks(self, weights: Weights, stored_bytes: int, stored_per_parameter: float,
                      lowered: int) -> dict[str, int]:
        """The peaks of the stages every export runs."""
        vocab = weights.vocab
        vocab_stored = int(vocab * (1 if weights.tied else 2) * stored_per_parameter)
        return {
            # Random weights are made in place, the largest matrix through a temporary of its size.
            "load": BASE_BYTES + stored_bytes + (vocab * int(stored_per_parameter) if self.random_init else 0),
            # The linears are cast and quantized one at a time beside the stored weights; then the embedding (an
            # untied lm_head, other tables) beside the quantized linears, each cast to fp32 whole for its quantizer.
            "quantize": BASE_BYTES + QUANTIZE_BASE + max(
                stored_bytes + weights.largest_linear * 4 * 2,
                weights.eager - weights.vocab_eager - weights.tables_eager + vocab_stored
                + int(weights.tables * stored_per_parameter) + max(vocab, weights.largest_table) * 4),
            # XNNPACK's preprocess copies the partition it packs and repacks it: the vocabulary matrices' dominate.
            "lower": lowered - LOWERED_BASE + weights.program + int(PREPROCESS_PER_VOCAB * vocab),
            "emit": lowered + weights.program + int(EMIT_PER_VOCAB * vocab),
        }

    def _calibrated_quantize(self, shapes: CausalLM, weights: Weights, stored_bytes: int) -> int:
        """What quantize holds when a calibration text runs the model or a rotation turns it: the model whole in
        quant.dtype beside the stored weights and the quantized layers as they are made (and, distilling, what
        learning holds)."""
        # The rotations are learned before the scales are (each phase frees what it held).
        learning = max(distill_bytes(shapes, self.quant) if self.quant.algorithm == Algorithm.distill else 0,
                       learned_rotation_bytes(shapes, self.quant) if self.quant.rotation == RotationKind.learned else 0)
        return stored_bytes + weights.eager + shapes.parameter_count() * DTYPES[self.quant.dtype].itemsize + learning

    def _validation_peaks(self, weights: Weights, stored_bytes: int, lowered: int, logits: int) -> dict[str, int]:
        # torchao's eager linear dequantizes a quantized lm_head (its own, or the embedding quantized once) to fp32 at
        # each call, with its temporaries about twice.
        head_quantized = (weights.tying == TiedEmbedding.QUANTIZED_ONCE
                          or (not weights.tied and self.quant.lm_head is not None))
        return {
            # The unquantized model scores the validation windows.
            "baseline": BASE_BYTES + stored_bytes + logits,
            # The program loaded beside the eager model, whose lm_head is dequantized at each call, and both sides'
            # logits.
            "validate": lowered + weights.program + (weights.vocab * 4 * 2 if head_quantized else 0) + logits,
        }

    def check(self, footprint: Footprint) -> Footprint:
        """``footprint``, refused if it does not fit."""
        check_fits(footprint, self.limit_gb)
        return footprint


def available_memory() -> int:
    """Bytes this machine can give a new process now (Linux: MemAvailable; else all physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit(limit_gb: float | None) -> int:
    """Bytes an export may use: ``export.memory_limit_gb``, or (None) the memory available now."""
    return available_memory() if limit_gb is None else int(limit_gb * GB)


def check_fits(footprint: Footprint, limit_gb: float | None) -> None:
    """Refuse an export whose estimated peak exceeds ``limit_gb`` (None: the memory available now)."""
    limit = memory_limit(limit_gb)
    if footprint.peak <= limit:
        return
    where = f"export.memory_limit_gb={limit_gb}" if limit_gb is not None else "the memory this machine has available"
    raise UserError(
        f"this export would not fit: {footprint.describe()}, above {where} ({limit / GB:.1f} GB). What to change: "
        "a smaller quant (quant=8da4w_emb4w stores 4-bit weights, about 1.2 bytes per parameter in memory), "
        "validate=false (validation loads the program beside the eager model), or a machine with more memory. "
        "If the estimate is wrong for this machine (swap, or memory freed since), set export.memory_limit_gb.")


# Peak RSS an encoder beside the decoder adds to an export, per byte of its fp32 weights: measured on SmolVLM-256M's
# vision encoder (docs/vision.md; 3215 MB measured against 1819 MB estimated for the decoder alone, over 374 MB of fp32
# encoder weights: the eager encoder, its captured and lowered graphs, the program's copy at validation). The audio
# encoder and Gemma 4's assistant, quantized, captured and lowered as one is, take it until their own are measured.
ENCODER_PEAK_PER_BYTE = 3.7


def encoder_footprint(parameters: int, peak_per_byte: float = ENCODER_PEAK_PER_BYTE) -> Footprint:
    """What an encoder beside the decoder (vision, audio) adds to the export's memory, held from load to the end:
    its fp32 weights, and ``peak_per_byte`` times them at each stage's peak (measured per kind)."""
    fp32 = 4 * parameters
    return Footprint(parameters, fp32, fp32, fp32,
                     {stage: BASE_BYTES + int(peak_per_byte * fp32)
                      for stage in ("load", "quantize", "lower", "emit", "validate")})

