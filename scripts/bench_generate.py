"""How much of the program's decode speed ``exporters.generate`` delivers.

    python scripts/bench_generate.py <run folder or .pte> [--prompt-len 64] [--steps 64] [--repeats 5]

Measures, on one loaded program: the bare loop (the step method called with argmax tokens, nothing else)
and ``Generator.generate`` (sampling, eos checks, streaming text) over the same number of new tokens, and
prefill alone. Medians after a warm-up; the ratio generate/bare is what the Python loop costs.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from exporters.runtime.speed import time_round
from exporters.runtime.generator import Generator, SamplingConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("program")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    gen = Generator(args.program)
    gen.eos_ids = set()  # the same number of tokens every time
    vocab = int(gen.program.constant("get_vocab_size"))
    sampling = SamplingConfig(max_new_tokens=args.steps)
    bare, ours, prefill = [], [], []
    for r in range(args.repeats + 1):
        prompt = torch.randint(3, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(r))
        # Alternate which of the two runs first, so neither always runs on a warmer machine.
        if r % 2:
            rate = gen.generate("", sampling, prompt_ids=prompt[0].tolist()).generation_tokens_per_s
        prefill_s, bare_s = time_round(gen.driver, prompt, args.steps)  # the bare loop: argmax tokens only
        if not r % 2:
            rate = gen.generate("", sampling, prompt_ids=prompt[0].tolist()).generation_tokens_per_s
        if r:  # the first round warms up
            prefill.append(args.prompt_len / prefill_s)
            bare.append(args.steps / bare_s)
            ours.append(rate)
    b, g, p = statistics.median(bare), statistics.median(ours), statistics.median(prefill)
    print(f"load {gen.load_seconds:.2f} s; prefill {p:.1f} tok/s ({args.prompt_len} tokens); decode: bare loop "
          f"{b:.1f} tok/s, generate {g:.1f} tok/s ({g / b:.1%} of bare)")


if __name__ == "__main__":
    main()
