"""What a backend can do, as one typed object: read once from its option file (``conf/backend``) and the
registries (partitioners, PT2E quantizers, device precision), then asked by name everywhere else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exporters.config import Attention, BackendConfig, DType, Pt2eQuantizer, WeightsPlacement
from exporters.backends import BACKENDS, runtime_precision
from exporters.quant.pt2e import PT2E_QUANTIZERS


@dataclass(frozen=True)
class BackendCapabilities:
    name: str
    partitioner: str  # a key of exporters.backends.BACKENDS
    options: dict[str, Any]  # passed to the partitioner factory
    dynamic_shapes: bool  # prompt methods take any length (else a fixed export.prefill_chunk)
    attention: Attention  # the attention kernels it prefers
    runs_here: bool  # this host's runtime executes its delegate (else validation runs the undelegated programs)
    runs_in: DType | None  # the precision its device computes in when the device picks it (OpenVINO), else None
    dtypes: tuple[DType, ...]
    linear: tuple[str | None, ...]  # the linear schemes its kernels run
    embedding: tuple[str | None, ...]
    weights: tuple[WeightsPlacement, ...]  # where it can write weights (export.weights)
    adapter_data_files: bool  # each adapter's weights can go to a data file of its own
    pt2e_quantizers: tuple[Pt2eQuantizer, ...]  # its own PT2E quantizers (quant=pt2e_*)
    packed_once: str  # what a runtime needs so that the methods share one copy of the weights in memory

    @staticmethod
    def of(cfg: BackendConfig) -> "BackendCapabilities":
        return BackendCapabilities(
            name=cfg.name, partitioner=cfg.partitioner, options=dict(cfg.options), dynamic_shapes=cfg.dynamic_shapes,
            attention=cfg.attention, runs_here=cfg.runs_here, runs_in=runtime_precision(cfg),
            dtypes=tuple(cfg.supported_dtypes), linear=tuple(cfg.supported_linear),
            embedding=tuple(cfg.supported_embedding), weights=tuple(cfg.supported_weights),
            adapter_data_files=cfg.adapter_data_files,
            pt2e_quantizers=tuple(q for q, recipe in PT2E_QUANTIZERS.items() if recipe.backend == cfg.name),
            packed_once=BACKENDS[cfg.partitioner].packed_once
            or f"The {cfg.name} delegate's own loader decides (not measured here).")

    @property
    def stores_weights_externally(self) -> bool:
        return WeightsPlacement.external in self.weights
