"""Emit: ``to_executorch`` with one KV cache shared by all methods, written to disk atomically."""

from __future__ import annotations

from pathlib import Path

from exporters.artifacts import EmittedProgram, LoweredProgram
from exporters.files import sha256_of, write_atomically
from exporters.pipeline import Stage
from exporters.pte_contents import storage_breakdown


def backend_config():  # type: ignore[no-untyped-def]
    """Shared mutable buffers: decode continues the cache prefill wrote (docs/DESIGN.md: 0.31 error without)."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass

    return ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
        emit_mutable_buffer_names=True,
        # The KV-cache update (index_copy -> index_put) is rewritten in place instead of copying the cache.
        run_reinplace_pass=True,
        do_quant_fusion_and_const_prop=True,
    )


def provisional_path(final: Path) -> Path:
    """Where the program sits until validation accepts it: cannot be mistaken for a finished export."""
    return final.with_name(final.stem + ".unvalidated" + final.suffix)


class EmitStage(Stage):
    name = "emit"

    def __init__(self, final_path: Path) -> None:
        self.final_path = final_path

    def run(self, lowered: LoweredProgram) -> EmittedProgram:
        program = lowered.edge.to_executorch(backend_config())
        # The edge programs are not needed past this point (to_executorch transformed copies of them):
        # dropping them here keeps them out of the peak memory of serialization.
        lowered.edge = None
        path = provisional_path(self.final_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Streamed piece by piece: program.buffer would hold the whole file in memory once more.
        write_atomically(path, program.write_to_file)
        del program
        captured = lowered.captured
        storage = storage_breakdown(path)
        return EmittedProgram(
            quantized=captured.quantized,
            specs=captured.specs,
            signatures=captured.signatures,
            constant_methods=lowered.constant_methods,
            delegated_partitions=lowered.delegated_partitions,
            path=path,
            final_path=self.final_path,
            size_bytes=storage["total_bytes"],
            sha256=sha256_of(path),
            storage=storage,
            reference_programs=captured.reference_programs,
            aliases=captured.aliases,
        )
