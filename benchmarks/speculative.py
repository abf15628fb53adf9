"""Speculative decoding against plain decoding on one program with a verify method, per task.

    python -m benchmarks.speculative outputs/smollm2-verify [--tokens 128] [--repeats 3] [--out bench/spec.json]

For each task (a chat request whose answer repeats much of its prompt, a continuation of code, an open chat
answer), on one loaded program, greedy: decode tok/s without speculation and with ``speculative=lookup``, proposals
kept, tokens per call of the model, and whether the two outputs are the same tokens. A prompt longer than the
program's cache leaves room for (a tiny model's), only its end is kept. Medians over ``--repeats``
after a warm-up, the two modes alternating which runs first. Writes JSON (``--out``) beside the printed table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from exporters.runtime.generator import Generator, SamplingConfig, chat_prompt, chat_template

TEXT = ("The ferry leaves the north pier at seven every morning. It carries workers, bicycles and crates of fish "
        "across the bay, and it returns at noon with the post, the newspapers and the school children.")
TASKS: dict[str, tuple[str, bool]] = {
    # name: (prompt, apply the chat template)
    "edit": (f"Repeat this paragraph exactly, but with 'seven' replaced by 'eight':\n\n{TEXT}", True),
    "code": ("def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n"
             "    left = [x for x in items[1:] if x < pivot]\n    right = [x for x in items[1:] if x >= pivot]\n"
             "    return quicksort(left) + [pivot] + quicksort(right)\n\n\ndef mergesort(items):\n", False),
    "chat": ("What should I pack for a week of hiking in the mountains?", True),
}


def measure(run: Path, tokens: int, repeats: int) -> dict[str, dict[str, float | bool]]:
    gen = Generator(run)
    gen.eos_ids = set()  # the same number of tokens in both modes, every time
    greedy = SamplingConfig(max_new_tokens=tokens)
    found: dict[str, dict[str, float | bool]] = {}
    for task, (prompt, chat) in TASKS.items():
        text = chat_prompt(gen.pte, prompt) if chat and chat_template(gen.pte.parent) else prompt
        ids = gen.encode(text)
        room = gen.max_context_len - tokens - 1  # a short cache (a tiny model's) keeps the prompt's end
        if len(ids) > room:
            ids = ids[-room:]
        rates: dict[str, list[float]] = {"none": [], "lookup": []}
        outputs, stats = {}, None
        for r in range(repeats + 1):
            for mode in (("none", "lookup") if r % 2 else ("lookup", "none")):
                result = gen.generate(text, greedy, prompt_ids=ids, speculative=mode)
                outputs[mode] = result.new_ids
                if mode == "lookup":
                    stats = result.speculation
                if r:  # the first round warms up
                    rates[mode].append(result.generation_tokens_per_s)
        assert stats is not None
        plain, fast = statistics.median(rates["none"]), statistics.median(rates["lookup"])
        found[task] = {"decode_tok_s": round(plain, 1), "lookup_tok_s": round(fast, 1),
                       "speedup": round(fast / plain, 2), "acceptance": round(stats.acceptance, 3),
                       "tokens_per_call": round(stats.tokens_per_call, 2),
                       "identical": outputs["lookup"] == outputs["none"]}
        print(f"{task}: {found[task]}", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="a run folder (or .pte) exported with verify in export.methods")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    found = measure(args.run, args.tokens, args.repeats)
    print("\n| task | decode tok/s | with lookup | speedup | proposals kept | tokens per call | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for task, r in found.items():
        print(f"| {task} | {r['decode_tok_s']} | {r['lookup_tok_s']} | {r['speedup']}x | {r['acceptance']:.0%} | "
              f"{r['tokens_per_call']} | {'yes' if r['identical'] else 'NO'} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"run": str(args.run), "tokens": args.tokens, "tasks": found}, indent=2) + "\n")


if __name__ == "__main__":
    main()
