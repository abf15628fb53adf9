"""How much of the program's decode speed ``exporters.generate`` delivers.

    python -m benchmarks.generate bench/smollm2/llm-exporters      # a run folder or .pte
    python -m benchmarks.generate --preset smollm2 [--quant 8da4w] [--prompt-len 64] [--steps 64] [--repeats 5]

With ``--preset`` it first exports that preset (our exporter, xnnpack, ``--quant``, validate=false) into ``--out``.
Measures, on one loaded program: the bare loop (the step method called with argmax tokens, nothing else)
and ``Generator.generate`` (sampling, eos checks, streaming text) over the same number of new tokens, and
prefill alone. Medians after a warm-up; the ratio generate/bare is what the Python loop costs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.exporting import export_preset
from benchmarks.presets import add_preset_arguments, preset_of
from exporters.runtime.generator import Generator, SamplingConfig, resolve_program
from exporters.runtime.programs import LoadedProgram
from exporters.runtime.speed import time_round
from models.tokenizer import find_tokenizer


def stand_in_tokenizer(vocab_size: int) -> Path:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens (trained on models.tiny's corpus), for programs
    without one (random-weight presets), whose generated text is noise anyway: generate still decodes and
    streams every token, as it does with a real tokenizer."""
    from models.tiny import train_tokenizer

    path = Path(tempfile.mkdtemp(prefix="stand_in_tokenizer_")) / "tokenizer.json"
    train_tokenizer(vocab_size).save(str(path))
    return path


def measure(program: str | Path, prompt_len: int, steps: int, repeats: int,
            tokenizer: str | Path | None = None) -> dict[str, float]:
    """Load time, and median prefill, bare-loop and generate throughput (tokens/s) of one program."""
    pte = resolve_program(program)
    if tokenizer is None and find_tokenizer(pte.parent) is None:
        tokenizer = stand_in_tokenizer(int(LoadedProgram(pte).constant("get_vocab_size")))
        print(f"{pte.parent} has no tokenizer: streaming text with a stand-in one", flush=True)
    gen = Generator(pte, None if tokenizer is None else str(tokenizer))
    gen.eos_ids = set()  # the same number of tokens every time
    vocab = int(gen.program.constant("get_vocab_size"))
    sampling = SamplingConfig(max_new_tokens=steps)
    bare, ours, prefill = [], [], []
    for r in range(repeats + 1):
        prompt = torch.randint(3, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(r))
        # Alternate which of the two runs first, so neither always runs on a warmer machine.
        if r % 2:
            rate = gen.generate("", sampling, prompt_ids=prompt[0].tolist()).generation_tokens_per_s
        prefill_s, bare_s = time_round(gen.driver, prompt, steps)  # the bare loop: argmax tokens only
        if not r % 2:
            rate = gen.generate("", sampling, prompt_ids=prompt[0].tolist()).generation_tokens_per_s
        if r:  # the first round warms up
            prefill.append(prompt_len / prefill_s)
            bare.append(steps / bare_s)
            ours.append(rate)
    return {"load_s": gen.load_seconds, "prefill_tok_s": statistics.median(prefill),
            "bare_decode_tok_s": statistics.median(bare), "generate_tok_s": statistics.median(ours)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("program", nargs="?", help="a run folder or .pte (else --preset exports one)")
    add_preset_arguments(ap, default=None)
    ap.add_argument("--quant", default="8da4w", help="quant option of the --preset export (conf/quant)")
    ap.add_argument("--max-seq-len", type=int, default=256, help="context of the --preset export")
    ap.add_argument("--out", type=Path, default=None, help="folder for the --preset export (default: a temp dir)")
    ap.add_argument("--tokenizer", help="tokenizer.json / tokenizer.model (default: the one next to the program)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if (args.program is None) == (args.preset is None):
        ap.error("give either a program (run folder or .pte) or --preset NAME")
    program = args.program
    if program is None:
        out = args.out or Path(tempfile.mkdtemp(prefix="bench_generate_"))
        print(f"exporting {args.preset} ({args.quant}, max_seq_len {args.max_seq_len}) into {out} ...", flush=True)
        program = export_preset(preset_of(args), out, [f"quant={args.quant}", f"export.max_seq_len={args.max_seq_len}",
                                                       "validate=false", "bench=false"]).pte_path
    m = measure(program, args.prompt_len, args.steps, args.repeats, args.tokenizer)
    b, g, p = m["bare_decode_tok_s"], m["generate_tok_s"], m["prefill_tok_s"]
    print(f"load {m['load_s']:.2f} s; prefill {p:.1f} tok/s ({args.prompt_len} tokens); decode: bare loop "
          f"{b:.1f} tok/s, generate {g:.1f} tok/s ({g / b:.1%} of bare)")


if __name__ == "__main__":
    main()
