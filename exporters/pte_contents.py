"""What a ``.pte`` stores, by kind: shared weights, other constants, and everything else (graphs).

Used for the manifest and to prove that extra methods add graph bytes but no weight bytes.
"""

from __future__ import annotations

from typing import Any


def storage_breakdown(data: bytes) -> dict[str, Any]:
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = deserialize_pte_binary(data)
    named = pte.named_data
    named_bytes = sum(len(b) for b in named.buffers) if named is not None else 0
    constants = sum(len(b.storage) for b in pte.program.constant_buffer)
    return {
        "total_bytes": len(data),
        # Backend weights keyed by content (XNNPACK / Core ML NamedDataStore): each stored once.
        "named_data_entries": len(named.pte_data) if named is not None else 0,
        "named_data_bytes": named_bytes,
        # Constants of non-delegated ops (e.g. the embedding table on XNNPACK, all weights on portable).
        "constant_buffer_bytes": constants,
        "graph_and_other_bytes": len(data) - named_bytes - constants,
    }
