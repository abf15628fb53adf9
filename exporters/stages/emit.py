"""Emit: ``to_executorch`` with one KV cache shared by all methods, written to disk atomically (with
``export.weights=external``, the weights to a ``.ptd`` beside the program)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

from exporters.config import WeightsPlacement
from exporters.context import ExportContext
from exporters.context.artifacts import LoweredProgram, WrittenProgram
from exporters.manifest import DataFile
from exporters.output.files import sha256_of, write_atomically
from exporters.output.folder import is_no_room, no_room
from exporters.program.dynamic import convolutions_unguarded
from exporters.program.contents import data_file_entries, storage_breakdown
from exporters.program.internals import delegate_calls_traced_from_their_outputs, reserialize, tensor_data_bytes
from exporters.program.weights import data_path_for, data_tag, external_constant_tag
from exporters.stages.pipeline import Stage


def backend_config(external: bool = False):  # type: ignore[no-untyped-def]
    """Shared mutable buffers: decode continues the cache prefill wrote (docs/DESIGN.md: 0.31 error without).
    ``external``: the constants of non-delegated ops go to the data files lowering tagged them for."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass

    return ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
        emit_mutable_buffer_names=True,
        # The KV-cache update (index_copy -> index_put) is rewritten in place instead of copying the cache.
        run_reinplace_pass=True,
        do_quant_fusion_and_const_prop=True,
        external_constants=external_constant_tag if external else False,
    )


def to_executorch(edge: Any, aliases: dict[str, str], external: bool = False) -> Any:
    """``edge.to_executorch``, then each alias (forward = prefill) added as its source's execution plan renamed.

    ``to_executorch`` runs its passes and memory planning once per method, and for an alias they would cost
    as much as for its source and give the same plan: emitting forward from its own copy of prefill's graph
    wrote a plan equal to prefill's but for its name (delegate segments, constants and memory plan included;
    checked on xnnpack, portable and vulkan programs), and took a third of emit on SmolLM2 (docs/DESIGN.md, 2c).
    """
    config = backend_config(external)
    with convolutions_unguarded():  # memory planning traces again: the dynamic ranges stay whole
        manager = edge.to_executorch(config)
    if not aliases:
        return manager
    program = manager.executorch_program
    n_methods = len(manager.methods)  # the methods' plans come first, by name; the constant methods' follow
    plans = {plan.name: plan for plan in program.execution_plan[:n_methods]}
    for alias, source in aliases.items():
        # A deep copy (small: the data lives outside the plans): the serializer rewrites each plan's delegates.
        plans[alias] = dataclasses.replace(copy.deepcopy(plans[source]), name=alias)
        for debug_map in (manager.debug_handle_map, manager.delegate_map, manager.instruction_id_to_num_outs_map):
            if source in debug_map:
                debug_map[alias] = debug_map[source]
    program.execution_plan = [plans[name] for name in sorted(plans)] + program.execution_plan[n_methods:]
    # The manager serialized the program when it was built (its constructor emits and serializes):
    # serialize it again, now with the aliases.
    reserialize(manager, config)
    return manager


def provisional_path(final: Path) -> Path:
    """Where the program sits until validation accepts it: cannot be mistaken for a finished export."""
    return final.with_name(final.stem + ".unvalidated" + final.suffix)


def write_data_files(manager: Any, pte: Path, adapters: list[str]) -> dict[str | None, DataFile]:
    """The manager's data files written beside ``pte`` (the base's weights, then one file per adapter: key None
    and the adapter's name), atomically: ExecuTorch writes them into a private folder under their tags' names, and
    each is renamed into place once all are complete."""
    paths = {owner: data_path_for(pte, owner) for owner in [None, *adapters]}
    with tempfile.TemporaryDirectory(dir=pte.parent, prefix=f".{pte.name}.") as folder:
        manager.write_tensor_data_to_file(folder)
        written = {path.stem: path for path in Path(folder).iterdir()}
        expected = {data_tag(owner): owner for owner in paths}
        assert set(written) == set(expected), f"expected data files {sorted(expected)}, ExecuTorch wrote {sorted(written)}"
        for tag, path in written.items():
            with open(path, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(path, paths[expected[tag]])
    return {owner: DataFile(file=path.name, size_bytes=path.stat().st_size, sha256=sha256_of(path),
                            entries=data_file_entries(path)) for owner, path in paths.items()}


class _Counter:
    """A file that keeps nothing: counts the bytes written to it."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: bytes) -> int:
        self.size += len(data)
        return len(data)


def bytes_to_write(program: Any, external: bool) -> int | None:
    """What the program and its data files take on disk (the program serialized once more, into a counter)."""
    counter = _Counter()
    program.write_to_file(counter)
    data = tensor_data_bytes(program) if external else 0
    return None if data is None else counter.size + data


class EmitStage(Stage):
    name = "emit"
    after = ("lower",)

    def run(self, lowered: LoweredProgram, ctx: ExportContext) -> WrittenProgram:
        edge, aliases = lowered.edge, lowered.methods.aliases
        kept = {f: getattr(lowered, f) for f in ("model", "methods", "constant_methods", "delegated_partitions",
                                                  "undelegated", "components")}
        del lowered  # the only other reference to the edge programs: dropped with them after to_executorch
        external = self.plan.weights == WeightsPlacement.external
        with delegate_calls_traced_from_their_outputs() if self.plan.shortcuts else contextlib.nullcontext():
            program = to_executorch(edge, aliases, external=external)
        # to_executorch consumed the edge programs: freeing them here keeps them out of serialization's peak.
        del edge
        final_path = ctx.output_dir / self.plan.output_name
        path = provisional_path(final_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # Streamed piece by piece: program.buffer would hold the whole file in memory once more.
            write_atomically(path, program.write_to_file)
            data = write_data_files(program, path, kept["methods"].adapters) if external else {}
        except OSError as e:
            if not is_no_room(e):
                raise
            files = final_path.name + (f" and its data file{'s' if kept['methods'].adapters else ''}" if external else "")
            raise no_room(e, files, final_path.parent, bytes_to_write(program, external)) from None
        del program
        storage = storage_breakdown(path)
        return WrittenProgram(**kept, path=path, final_path=final_path, size_bytes=storage["total_bytes"],
                              sha256=sha256_of(path), storage=storage, data=data.pop(None, None),
                              adapter_data=data)
