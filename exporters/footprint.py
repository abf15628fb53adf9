"""What an export will hold in memory, estimated from the architecture before any weight is read.

A model that cannot fit is refused at the start with the estimate and what to change, rather than killed by the
kernel's out-of-memory killer half an hour in. The weights are counted in each form the export holds them: as stored
(the checkpoint's dtype; random weights are made in bf16), as the quantized eager model keeps them (torchao: one int8
code per weight, an fp32 scale and an int8 zero point per group), and as the program stores them (packed codes,
scales). Each stage's peak is those forms alive at once plus what the stage itself adds, measured on the 8B shape
and its 2-layer cut (docs/DESIGN.md 10).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from exporters.config import QuantConfig, TiedEmbeddingStorage
from exporters.errors import UserError
from exporters.quant.mixed import Precision
from exporters.quant.tied import TiedEmbedding
from exporters.quant.tied import plan_tied_embedding as tie_plan
from exporters.quant.schemes import DTYPES, EMBEDDING_SCHEMES, LINEAR_SCHEMES, layer_scheme
from models.decoder import CausalLM

if TYPE_CHECKING:
    from exporters.plan import Component, ExportPlan

GB = 1e9
# RSS of the exporter with torch, torchao and ExecuTorch imported, before any weight (measured: 0.4-0.5 GB).
BASE_BYTES = int(0.5 * GB)


@dataclass(frozen=True)
class Footprint:
    """Bytes of the weights in each form, and the export's estimated peak RSS and the stage it falls in."""

    parameters: int
    stored: int  # as loaded (the checkpoint's dtype)
    eager: int  # the quantized eager model
    program: int  # the program's weights
    peaks: dict[str, int]  # each stage's estimated peak RSS
    advise: int | None = None  # the advise stage's, if the quality warning sets it off (not refused: it may not run)

    @property
    def peak_stage(self) -> str:
        return max(self.peaks, key=self.peaks.__getitem__)

    @property
    def peak(self) -> int:
        return self.peaks[self.peak_stage]

    def beside(self, other: "Footprint") -> "Footprint":
        """This model's footprint with ``other`` held in the same export (the target and its draft: both alive from
        load to finalize, each stage working on one then the other): weights add up, and so, conservatively, do the
        stages' peaks."""
        held = BASE_BYTES + other.eager
        return Footprint(self.parameters + other.parameters, self.stored + other.stored, self.eager + other.eager,
                         self.program + other.program,
                         {s: peak + other.peaks.get(s, held) - BASE_BYTES for s, peak in self.peaks.items()},
                         None if self.advise is None else self.advise + other.eager)

    def describe(self) -> str:
        return (f"{_count(self.parameters)} parameters: {_size(self.stored)} as stored, {_size(self.eager)} "
                f"quantized in memory, {_size(self.program)} in the program; estimated peak RSS "
                f"{self.peak / GB:.1f} GB (in {self.peak_stage})"
                + (f", {self.advise / GB:.1f} GB if the quality warning's remedies are measured (advise)"
                   if self.advise is not None and self.advise > self.peak else ""))


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


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


def estimate(model: CausalLM, quant: QuantConfig, stored_bytes: int, validating: bool,
             tied_storage: TiedEmbeddingStorage = TiedEmbeddingStorage.shared, cast_whole: bool = False,
             advising: bool = False) -> Footprint:
    """The footprint of exporting ``model`` (built on the meta device: only shapes are read) quantized by ``quant``,
    its weights ``stored_bytes`` as loaded. ``cast_whole``: the model is cast whole to ``quant.dtype`` before
    quantizing (a calibration text runs it, a rotation turns it: ``exporters.plan.QuantPlan.cast_whole``).
    ``advising``: the advise stage may quantize fresh copies of the model
    beside the export's."""
    dtype_bytes = DTYPES[quant.dtype].itemsize
    head, embed = model.lm_head, model.model.embed_tokens
    # Whether lm_head ends up with a matrix of its own (exporters.quant.tied decides as quantization will).
    tied = tie_plan(model, quant, tied_storage) in (TiedEmbedding.SHARED, TiedEmbedding.QUANTIZED_ONCE)
    eager = program = largest_linear = 0
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
        else:
            e = p = sum(t.numel() for t in module.parameters(recurse=False) if id(t) not in counted) * dtype_bytes
        counted.update(id(t) for t in module.parameters(recurse=False))
        eager, program = eager + e, program + p
    parameters = model.parameter_count()
    vocab_matrices = embed.weight.numel() * (1 if tied else 2)
    stored_per_parameter = stored_bytes / parameters
    vocab_stored = int(vocab_matrices * stored_per_parameter)
    vocab_eager = _quantized_bytes(*embed.weight.shape, quant.embedding, quant.embedding_group_size,
                                   EMBEDDING_SCHEMES, dtype_bytes)[0] * (1 if tied else 2)
    # The largest matrix torchao's eager linear dequantizes to fp32 at each call (with its temporaries, about twice).
    head_dequantized = head.weight.numel() * 4 * 2 if not tied and quant.lm_head else 0
    # Lowering holds the eager model (its weights are the graphs' constants) and the packed copies it makes, plus
    # temporaries that follow the largest matrices (the vocabulary's: packing lm_head in lowering, then emit's constant
    # propagation of the embedding): about 2.5 bytes per parameter of one of them (8B shape and its 2-layer cut).
    lowered = BASE_BYTES + eager + program + int(2.5 * embed.weight.numel())
    peaks = {
        "load": BASE_BYTES + stored_bytes,
        # The linears are cast and quantized one at a time beside the stored weights; then the embedding (and an
        # untied lm_head) beside the quantized linears, each cast to fp32 whole for its quantizer.
        "quantize": BASE_BYTES + max(stored_bytes + largest_linear * 4 * 2,
                                     eager - vocab_eager + vocab_stored + embed.weight.numel() * 4),
        "lower": lowered,
        "emit": lowered,
    }
    whole = parameters * dtype_bytes  # the model cast whole to quant.dtype
    if cast_whole:  # calibrating runs the model, rotating turns it: whole in quant.dtype beside the stored weights
        peaks["quantize"] = max(peaks["quantize"], BASE_BYTES + stored_bytes + whole)
    if validating:
        # The unquantized model scores the validation windows: their logits and softmax over the vocabulary.
        peaks["baseline"] = BASE_BYTES + stored_bytes + 4 * model.args.max_context_len * embed.num_embeddings * 4
        # The eager side (one dequantized lm_head at a time), then the program loaded beside the eager model.
        peaks["validate"] = BASE_BYTES + eager + max(program, head_dequantized)
    # Each remedy advise measures is a fresh model, cast whole where it is calibrated (GPTQ), beside the export's eager
    # model. Advise runs only past the quality warning's threshold, so its peak is reported, not refused.
    advise = BASE_BYTES + eager + stored_bytes + whole if validating and advising else None
    return Footprint(parameters, stored_bytes, eager, program, peaks, advise)


@dataclass(frozen=True)
class MemoryBudget:
    """What the load stage checks an export against before reading any weight."""

    quant: QuantConfig
    tied_storage: TiedEmbeddingStorage
    validating: bool
    limit_gb: float | None  # export.memory_limit_gb; None: the memory available when the export starts
    cast_whole: bool = False  # the model is cast whole before quantizing (exporters.plan.QuantPlan.cast_whole)
    advising: bool = False  # the advise stage runs (validation.warn_ppl_increase)

    @staticmethod
    def of(plan: "ExportPlan", component: "Component | None" = None) -> "MemoryBudget":
        """What the plan's export holds for ``component`` (None: the decoder): its quantization, validation and
        (the decoder's only) advise."""
        component = plan.decoder if component is None else component
        quant, validation = component.quant, plan.validation
        return MemoryBudget(quant.config, quant.tied_storage, validation is not None, plan.memory_limit_gb,
                            cast_whole=quant.cast_whole, advising=component.is_decoder and validation is not None
                            and validation.advise_threshold is not None)

    def estimate(self, shapes: CausalLM, stored_bytes: int) -> Footprint:
        """``shapes``' footprint (a model on the meta device)."""
        return estimate(shapes, self.quant, stored_bytes, self.validating, self.tied_storage, self.cast_whole,
                        self.advising)

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


def check_fits(footprint: Footprint, limit_gb: float | None) -> None:
    """Refuse an export whose estimated peak exceeds ``limit_gb`` (None: the memory available now)."""
    limit = available_memory() if limit_gb is None else int(limit_gb * GB)
    if footprint.peak <= limit:
        return
    where = f"export.memory_limit_gb={limit_gb}" if limit_gb is not None else "the memory this machine has available"
    raise UserError(
        f"this export would not fit: {footprint.describe()}, above {where} ({limit / GB:.1f} GB). What to change: "
        "a smaller quant (quant=8da4w_emb4w stores 4-bit weights, about 1.2 bytes per parameter in memory), "
        "validate=false (validation loads the program beside the eager model), or a machine with more memory. "
        "If the estimate is wrong for this machine (swap, or memory freed since), set export.memory_limit_gb.")
