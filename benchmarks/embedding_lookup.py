"""What one eager lookup in a quantized embedding table costs: torchao's own (the whole table dequantized, then the
rows) against the decoder's (``models.decoder.Embedding``: the rows alone). Peak RSS above the table and time.

    python -m benchmarks.embedding_lookup                      # 1M x 256 table, 4-bit groups of 32, 5 rows
    python -m benchmarks.embedding_lookup --rows 262144 --dim 1536 --bits 8

The same values either way (tests/test_quantized_embedding.py); this measures why the decoder does not use torchao's.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
from torch import nn


def measured(lookup: Callable[[], torch.Tensor]) -> tuple[float, float]:
    """(peak RSS above the RSS before, in MB; milliseconds) of one call."""
    from exporters.runtime.memory import current_rss_mb, peak_rss_mb, reset_peak_rss

    reset_peak_rss()
    before, started = current_rss_mb(), time.perf_counter()
    with torch.no_grad():
        lookup()
    return peak_rss_mb() - before, (time.perf_counter() - started) * 1000


def main() -> None:
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    from models.decoder import Embedding

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--lookup", type=int, default=5, help="rows looked up")
    args = ap.parse_args()
    table = Embedding(args.rows, args.dim)
    quantize_(table, IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{args.bits}"),
                                          granularity=PerGroup(args.group)),
              filter_fn=lambda m, _: isinstance(m, nn.Embedding))
    ids = torch.randint(0, args.rows, (1, args.lookup), generator=torch.Generator().manual_seed(0))
    print(f"{args.rows} x {args.dim} table, {args.bits}-bit groups of {args.group} "
          f"({args.rows * args.dim * 4 / 2**20:.0f} MB in fp32), {args.lookup} rows looked up:")
    for name, lookup in (("torchao's lookup", lambda: nn.functional.embedding(ids, table.weight)),
                         ("models.decoder.Embedding", lambda: table(ids))):
        peak, ms = measured(lookup)
        print(f"  {name:26s} peak +{peak:,.0f} MB, {ms:,.1f} ms")


if __name__ == "__main__":
    main()
