"""The decoder's embedding lookup in a quantized table (models.decoder.Embedding): the values torchao's lookup gives,
without dequantizing the whole table in eager, and torchao's own lookup where the program is captured."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchao.quantization import IntxWeightOnlyConfig, quantize_
from torchao.quantization.granularity import PerAxis, PerGroup

from models.decoder import Embedding


def _quantized(dtype: torch.dtype, bits: torch.dtype, granularity: object) -> Embedding:
    torch.manual_seed(0)
    table = Embedding(300, 64).to(dtype)
    quantize_(table, IntxWeightOnlyConfig(weight_dtype=bits, granularity=granularity),
              filter_fn=lambda m, _: isinstance(m, nn.Embedding))
    return table


@pytest.mark.parametrize("dtype,bits,granularity", [(torch.float32, torch.int4, PerGroup(32)),
                                                   (torch.bfloat16, torch.int8, PerAxis(0))])
def test_a_quantized_lookup_reads_its_rows_as_torchao_dequantizes_them(dtype: torch.dtype, bits: torch.dtype,
                                                                       granularity: object) -> None:
    table = _quantized(dtype, bits, granularity)
    ids = torch.tensor([[3, 299, 0, 17, 3]])
    expected = nn.functional.embedding(ids, table.weight.dequantize())  # torchao's: the whole table, then the rows

    def whole_table() -> torch.Tensor:
        raise AssertionError("the whole table was dequantized for a lookup of 5 rows")

    table.weight.dequantize = whole_table  # this table's own, not the rows' it makes
    assert torch.equal(table(ids), expected)


def test_the_captured_lookup_is_torchaos_own() -> None:
    """What ExecuTorch's quantized embedding kernels replace: the table dequantized, then looked up."""
    table = _quantized(torch.float32, torch.int4, PerGroup(32))
    program = torch.export.export(table, (torch.tensor([[1, 2]]),), strict=False)
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert "torchao.dequantize_affine.default" in ops and ops[-1] == "aten.embedding.default"
