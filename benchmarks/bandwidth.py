"""Decode against the memory-bandwidth bound: how close a program's decode comes to what this machine can stream.

    python -m benchmarks.bandwidth --preset smollm2 bench/smollm2/llm-exporters/model.pte
    python -m benchmarks.bandwidth --preset 1b bench/1b/llm-exporters/model.pte --position 64 --profile

A decode step reads every weight its method uses once, the embedding row of its token and the KV cache up to its
position; on a CPU that is memory-bound, so ``bandwidth / bytes per token`` is the fastest decode this machine can
do. Four numbers per program:

1. **Read bandwidth**: torch sums a buffer far larger than the caches (``--buffer-gb``) with the threads the runtime
   uses (ExecuTorch's threadpool: one per core), the best of ``--repeats``, in GB/s (1e9 bytes); read before and
   after the programs run, and the higher bounds them (this shared machine's bandwidth drifts).
2. **Bytes per token**: the program's delegate weights (its named data: every packed linear and lm_head), one row of
   the table of each non-delegated constant read by token (the embedding: the constant segment over the vocabulary),
   and the KV cache at the position (2 x layers x kv heads x head dim x position x 4 bytes, fp32 cache).
3. **Decode tok/s** at that position, measured as ``exporters.runtime.speed`` measures it (median of rounds).
4. With ``--profile``: where a step's time goes (ExecuTorch's ETDump, ``benchmarks.profile_ops``).

The fraction of the bound is ``tok/s x bytes per token / bandwidth``. Run it alone: a second heavy process halves the
bandwidth each sees.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.presets import Preset, add_preset_arguments, preset_of

GB = 1e9


def read_bandwidth(buffer_gb: float, threads: int, repeats: int) -> float:
    """Bytes per second ``threads`` threads read from memory (the best of ``repeats`` sums of a large buffer)."""
    kept = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(int(buffer_gb * GB) // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass also faults the pages in
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        return buffer.numel() * 4 / best
    finally:
        torch.set_num_threads(kept)


def kv_bytes_per_position(p: Preset) -> int:
    """Bytes of an fp32 KV cache per position: keys and values of every layer."""
    return 2 * p.layers * p.kv_dim * 4


@dataclass(frozen=True)
class Traffic:
    """What one decode step of a program reads, and how fast the program decodes."""

    program: str
    weights: int  # delegate weights, read once per step
    token_rows: int  # one row of each table read by token (the embedding)
    kv: int  # the KV cache at the position
    decode_tok_s: float

    @property
    def per_token(self) -> int:
        return self.weights + self.token_rows + self.kv


@dataclass
class Bound:
    program: str
    bandwidth_gb_s: float
    weights_mb: float
    token_rows_kb: float
    kv_mb: float
    bytes_per_token_mb: float
    bound_tok_s: float
    decode_tok_s: float
    bytes_per_token: int  # exact, for the bound (the MB columns are rounded)

    @property
    def fraction(self) -> float:
        return self.decode_tok_s / self.bound_tok_s

    @classmethod
    def of(cls, t: Traffic, bandwidth: float) -> "Bound":
        """``t``'s bound at ``bandwidth`` (bytes/s): the tokens per second that reading its bytes would allow."""
        return cls(t.program, round(bandwidth / GB, 2), round(t.weights / 1e6, 1), round(t.token_rows / 1e3, 1),
                   round(t.kv / 1e6, 2), round(t.per_token / 1e6, 1), round(bandwidth / t.per_token, 1),
                   t.decode_tok_s, t.per_token)


def traffic_of(pte: Path, p: Preset, position: int, steps: int, repeats: int) -> Traffic:
    from exporters.program.contents import storage_breakdown
    from exporters.runtime.driver import Driver
    from exporters.runtime.programs import LoadedProgram
    from exporters.runtime.speed import measure_speed

    storage = storage_breakdown(pte)
    speed = measure_speed(Driver.of(LoadedProgram(pte, weight_cache=True)), position, steps, repeats, p.vocab)
    return Traffic(str(pte), weights=storage["named_data_bytes"],
                   token_rows=round(storage["constant_buffer_bytes"] / p.vocab),
                   kv=kv_bytes_per_position(p) * position, decode_tok_s=speed.decode_tokens_per_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset_arguments(ap, default="smollm2", layers=False)
    ap.add_argument("programs", nargs="+", type=Path, help=".pte files of the preset's architecture")
    ap.add_argument("--position", type=int, default=64, help="prompt tokens before the measured decode steps")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads reading memory (default: one per core, as ExecuTorch's threadpool)")
    ap.add_argument("--buffer-gb", type=float, default=2.0)
    ap.add_argument("--profile", action="store_true", help="also an ETDump profile of each program's decode step")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args()
    p = preset_of(args)
    # This shared machine's bandwidth drifts (46-70 GB/s seen on one day): read it before and after the programs
    # run and bound them by the higher, so a slow moment cannot flatter a fraction.
    before = read_bandwidth(args.buffer_gb, args.threads, args.repeats)
    traffic = [traffic_of(pte, p, args.position, args.steps, args.repeats) for pte in args.programs]
    after = read_bandwidth(args.buffer_gb, args.threads, args.repeats)
    bounds = [Bound.of(t, max(before, after)) for t in traffic]
    print(f"read bandwidth, {args.threads} threads: {before / GB:.2f} GB/s before the programs ran, {after / GB:.2f} "
          "after; the bound uses the higher")
    print(f"\n{args.preset}, decode at position {args.position}\n")
    print("| program | weights MB | token rows KB | KV MB | bytes/token MB | bound tok/s | decode tok/s | of bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for b in bounds:
        print(f"| {b.program} | {b.weights_mb} | {b.token_rows_kb} | {b.kv_mb} | {b.bytes_per_token_mb} | "
              f"{b.bound_tok_s} | {b.decode_tok_s} | {b.fraction:.0%} |")
    if args.profile:
        from benchmarks.profile_ops import profile, tables

        print("\n" + tables({pte.parent.name or str(pte): profile(pte, args.position, args.steps)
                              for pte in args.programs}, top=12))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"preset": args.preset, "position": args.position, "threads": args.threads,
                                        "bandwidth_before_gb_s": round(before / GB, 2),
                                        "bandwidth_after_gb_s": round(after / GB, 2),
                                        "bounds": [{**asdict(b), "fraction": round(b.fraction, 3)} for b in bounds]},
                                       indent=2))


if __name__ == "__main__":
    main()
