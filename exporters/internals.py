"""Every use of a private ExecuTorch or torchao internal, in one place, with the versions it was checked against.

Checked with executorch 1.4.1 and torchao 0.18.0 (pyproject.toml pins both). When either pin moves, these
are the lines to re-read; each has a test that fails if the internal changes behaviour:

- :func:`read_program_header`: ExecuTorch has no public reader of a ``.pte``'s flatbuffer alone (its public
  ``deserialize_pte_binary`` copies every weight segment: docs/DESIGN.md 2c).
  Test: ``tests/test_export.py::test_storage_breakdown_agrees_with_a_full_deserialization``.
- :func:`reserialize`: emit adds ``forward`` as ``prefill``'s execution plan renamed, then serializes the
  manager again; the manager keeps its serialized bytes in private fields.
  Test: ``tests/test_export.py::test_an_alias_is_written_as_executorch_plans_and_emits_it``.
- :func:`torchao_hqq_scale_only` / :func:`torchao_hqq_replaced`: torchao's HQQ scale-only solver, and the
  module-level name its intx weight tensors call it by, swapped for the row-blocked version in
  ``exporters.quant.hqq``. Test: ``tests/test_quant_backends.py::test_hqq_by_rows_is_torchaos_hqq_bit_for_bit``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

CHECKED_WITH = {"executorch": "1.4.1", "torchao": "0.18.0"}


def read_program_header(path: Path) -> Any:
    """The program flatbuffer of a ``.pte`` (graphs, tables, segment sizes), without reading its segments."""
    from executorch.exir._serialize._program import _flatbuffer_to_program, _get_extended_header

    with open(path, "rb") as f:
        header = _get_extended_header(f.read(64))
        f.seek(0)
        # Without an extended header there are no segments: the flatbuffer is the whole file.
        return _flatbuffer_to_program(f.read(header.program_size if header is not None else -1))


def reserialize(manager: Any, config: Any) -> None:
    """Serialize an ``ExecutorchProgramManager`` again after its ``executorch_program`` was edited.

    The manager serializes once, in its constructor, into private fields that ``write_to_file`` and ``buffer``
    read. The serializer copies the execution plans and shares the data.
    """
    from executorch.exir._serialize._serialize import serialize_for_executorch

    manager._pte_data, manager._tensor_data = serialize_for_executorch(
        manager._emitter_output, config, manager._data_serializer, manager._named_data)


def torchao_hqq_scale_only() -> Callable[..., Any]:
    """torchao's ``_choose_qparams_and_quantize_scale_only_hqq`` (whole-matrix HQQ, scale only)."""
    from torchao.quantization.quant_primitives import _choose_qparams_and_quantize_scale_only_hqq

    return _choose_qparams_and_quantize_scale_only_hqq


@contextlib.contextmanager
def torchao_hqq_replaced(replacement: Callable[..., Any]) -> Iterator[None]:
    """Within this block, torchao's intx weight tensors choose HQQ scales with ``replacement``."""
    from torchao.quantization.quantize_.workflows.intx import intx_unpacked_to_int8_tensor as intx

    original = intx._choose_qparams_and_quantize_scale_only_hqq
    intx._choose_qparams_and_quantize_scale_only_hqq = replacement
    try:
        yield
    finally:
        intx._choose_qparams_and_quantize_scale_only_hqq = original
