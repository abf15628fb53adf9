"""What a ``.pte`` stores, by kind: shared weights, other constants, and everything else (graphs).

Used for the manifest and to prove that extra methods add graph bytes but no weight bytes.

Only the program's flatbuffer (graphs and tables, a few hundred KB) is read: the weights sit in segments
after it, and the breakdown needs their sizes, which the flatbuffer lists. ExecuTorch's
``deserialize_pte_binary`` copies every segment back into Python objects, which was once the peak of the
whole export (docs/DESIGN.md 2c).
"""

from __future__ import annotations

from pathlib import Path

from exporters.program.internals import read_data_file_header, read_program_header


def storage_breakdown(path: Path) -> dict[str, int]:
    total = path.stat().st_size
    program = read_program_header(path)
    segment_sizes = [segment.size for segment in program.segments or []]
    named_data = program.named_data or []
    named_bytes = sum(segment_sizes[i] for i in {entry.segment_index for entry in named_data})
    if program.constant_segment is not None and len(program.constant_segment.offsets) > 0:
        constants = segment_sizes[program.constant_segment.segment_index]
    else:  # constants inline in the flatbuffer
        constants = sum(len(buffer.storage) for buffer in program.constant_buffer)
    return {
        "total_bytes": total,
        # Backend weights keyed by content (XNNPACK / Core ML NamedDataStore): each stored once.
        "named_data_entries": len(named_data),
        "named_data_bytes": named_bytes,
        # Constants of non-delegated ops (e.g. the embedding table on XNNPACK, all weights on portable).
        "constant_buffer_bytes": constants,
        "graph_and_other_bytes": total - named_bytes - constants,
    }


def data_file_entries(path: Path) -> int:
    """Named tensors in a ``.ptd`` (a weight several methods use is one entry)."""
    return len(read_data_file_header(path).named_data)


def delegate_ids(path: Path) -> set[str]:
    """The backends a program's methods delegate to (``XnnpackBackend``, ``OpenvinoBackend``, ...)."""
    return {delegate.id for plan in read_program_header(path).execution_plan for delegate in plan.delegates}


def delegate_calls(path: Path, method: str) -> int:
    """The delegate calls (backend partitions) in ``method``'s plan, as the runtime executes them."""
    plan = next(plan for plan in read_program_header(path).execution_plan if plan.name == method)
    return sum(type(i.instr_args).__name__ == "DelegateCall" for chain in plan.chains for i in chain.instructions)
