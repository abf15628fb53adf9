"""Speculative decoding against plain decoding on one program with a verify method, per task.

    python -m benchmarks.speculative outputs/smollm2-verify [--tokens 128] [--repeats 3] [--draft-tokens 1,2,4]
        [--out bench/spec.json]

For each task (a chat request whose answer repeats much of its prompt, a continuation of code, an open chat
answer), on one loaded program, greedy: decode tok/s without speculation, with ``speculative=lookup`` and, when the
program holds a draft model (or Gemma 4's assistant), with ``speculative=draft`` (proposals per call adapted, and each of ``--draft-tokens``
fixed); proposals kept, tokens per call of the model, and whether
each mode's output is the same tokens as plain decoding's. A prompt longer than the
program's cache leaves room for (a tiny model's), only its end is kept. Medians over ``--repeats``
after a warm-up, the modes taking turns to run first. Writes JSON (``--out``) beside the printed table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from exporters.program.draft import ASSISTANT_METHOD, DRAFT_METHODS
from exporters.runtime.driver import Driver
from exporters.runtime.generator import Generator, SamplingConfig, chat_prompt, chat_template, resolve_program
from exporters.runtime.memory import rss_after_load_mb
from exporters.runtime.programs import LoadedProgram

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


def mode_label(speculative: str, draft_tokens: int | None) -> str:
    """``lookup`` (proposals per call adapted), ``lookup k=2`` (always 2)."""
    return speculative if draft_tokens is None else f"{speculative} k={draft_tokens}"


def measure(run: Path, tokens: int, repeats: int, fixed: tuple[int, ...] = ()) -> dict[str, dict[str, dict[str, float | bool]]]:
    """task -> mode -> its numbers; the modes: none, lookup, and draft when the program holds a draft model, each
    proposing as many tokens per call as pay (adapted), and ``fixed`` numbers of them too (``lookup k=2``)."""
    gen = Generator(run)
    gen.eos_ids = set()  # the same number of tokens in every mode, every time
    names = set(gen.program.method_names)
    proposers = ["lookup", *(["draft"] if DRAFT_METHODS <= names or ASSISTANT_METHOD in names else [])]
    runs = {"none": ("none", None)}
    for proposer in proposers:
        runs |= {mode_label(proposer, k): (proposer, k) for k in (None, *fixed)}
    modes = list(runs)
    greedy = SamplingConfig(max_new_tokens=tokens)
    found: dict[str, dict[str, dict[str, float | bool]]] = {}
    for task, (prompt, chat) in TASKS.items():
        text = chat_prompt(gen.pte, prompt) if chat and chat_template(gen.pte.parent) else prompt
        ids = gen.encode(text)
        room = gen.max_context_len - tokens - 1  # a short cache (a tiny model's) keeps the prompt's end
        if len(ids) > room:
            ids = ids[-room:]
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        outputs, stats = {}, {}
        for r in range(repeats + 1):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:  # each mode runs first in turn
                speculative, k = runs[mode]
                result = gen.generate(text, greedy, prompt_ids=ids, speculative=speculative, draft_tokens=k)
                outputs[mode], stats[mode] = result.new_ids, result.speculation
                if r:  # the first round warms up
                    rates[mode].append(result.generation_tokens_per_s)
        plain = statistics.median(rates["none"])
        found[task] = {}
        for mode in modes:
            rate, st = statistics.median(rates[mode]), stats[mode]
            found[task][mode] = {"tok_s": round(rate, 1), "speedup": round(rate / plain, 2),
                                 "acceptance": round(st.acceptance, 3) if st else None,
                                 "tokens_per_call": round(st.tokens_per_call, 2) if st else 1.0,
                                 "identical": outputs[mode] == outputs["none"]}
        print(f"{task}: {found[task]}", flush=True)
    return found


def memory(run: Path) -> dict[str, float]:
    """RSS (MB) a fresh process gains by loading the methods plain decoding calls, and those speculation calls too
    (verify, and the draft's when the program has them): what speculation costs in memory."""
    pte = resolve_program(run)
    program = LoadedProgram(pte)
    roles = Driver.of(program).roles  # the methods' roles, read from the program without loading any
    plain = [roles.prompt, roles.step]
    speculative = plain + [roles.verify] if roles.verify else plain
    if DRAFT_METHODS <= set(program.method_names):
        speculative += sorted(DRAFT_METHODS)
    return {"plain_mb": rss_after_load_mb(pte, plain), "speculative_mb": rss_after_load_mb(pte, speculative)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="a run folder (or .pte) with a verify method (a draft, or verify in "
                                               "export.methods)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-tokens", default="", help="fixed proposals per call to measure beside the adapted "
                                                          "number, comma-separated (1,2,4,8)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    fixed = tuple(int(k) for k in args.draft_tokens.split(",") if k)
    found = measure(args.run, args.tokens, args.repeats, fixed)
    rss = memory(args.run)
    print(f"RSS after load: {rss['plain_mb']:.0f} MB with the plain methods, {rss['speculative_mb']:.0f} MB with "
          "those speculation calls too")
    print("\n| task | mode | tok/s | speedup | proposals kept | tokens per call | same tokens as none |")
    print("|---|---|---|---|---|---|---|")
    for task, modes in found.items():
        for mode, r in modes.items():
            kept = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
            print(f"| {task} | {mode} | {r['tok_s']} | {r['speedup']}x | {kept} | {r['tokens_per_call']} | "
                  f"{'yes' if r['identical'] else 'NO'} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"run": str(args.run), "tokens": args.tokens, "rss_after_load": rss, "tasks": found}, indent=2) + "\n")


if __name__ == "__main__":
    main()
