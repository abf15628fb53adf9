"""The server's cost over the program: what a request adds to time-to-first-token, and what the cache kept across a
chat's turns saves, measured through the official ``openai`` client on loopback.

    python -m benchmarks.serve outputs/smollm2 --out docs/results/serve-smollm2.json

A run folder whose cache holds at least ``--system-tokens`` + 100 positions (``export.max_context_len=1024``).
Measured, each the median of ``--repeats``:

- overhead: the server's time to the first streamed token of a short text completion, less the program's own
  prefill of the same prompt in this process (``exporters.runtime.generator``, as ``exporters.generate`` runs it):
  JSON, HTTP, tokenizing and the thread hand-over;
- the second turn of a chat whose system prompt is about ``--system-tokens`` tokens: its time to the first token
  against the first turn's (the first runs the whole prompt, the second only the new turn);
- that greedy answers are token for token what ``exporters.generate`` writes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.server_process import serving

SHORT = "Once upon a time, in a small town by the sea,"
SYSTEM = ("You are a helpful assistant for a small bakery. You answer questions about opening hours, bread, pastries, "
          "allergens, prices and orders. Keep answers short and friendly. ")


def first_token_s(route, model: str, **ask) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    """Seconds to the first streamed text through ``route`` (the client's chat or text completions), and the text."""
    start, first, text = time.perf_counter(), None, ""
    for chunk in route.create(model=model, stream=True, temperature=0, **ask):
        choice = chunk.choices[0] if chunk.choices else None
        piece = (choice.delta.content if hasattr(choice, "delta") else choice.text) if choice else None
        if piece and first is None:
            first = time.perf_counter() - start
        text += piece or ""
    return first if first is not None else float("nan"), text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--system-tokens", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from exporters import console
    from exporters.runtime.generator import Generator, SamplingConfig
    from exporters.server.engine import ChatTemplate

    with console.native_stderr_to(None):  # the runtime's own log lines
        generator = Generator(args.run)
    system = SYSTEM * max(1, args.system_tokens // len(generator.tokenizer.encode(SYSTEM)))
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "When do you open on Sunday?"}]
    prompt = ChatTemplate(args.run).render(turn1)  # what the server will run
    prefill, short_prefill = [], []
    for _ in range(args.repeats):
        result = generator.generate(prompt, SamplingConfig(1, 0.0, 1.0, 0))
        prefill.append(len(result.prompt_ids) / result.prompt_tokens_per_s)
        short = generator.generate(SHORT, SamplingConfig(1, 0.0, 1.0, 0))
        short_prefill.append(len(short.prompt_ids) / short.prompt_tokens_per_s)
    expected = generator.generate(prompt, SamplingConfig(24, 0.0, 1.0, 0)).text
    prompt_tokens = len(result.prompt_ids)
    del generator

    with serving(args.run, args.out.with_suffix(".log")) as server:
        client = server.client()
        model = client.models.list().data[0].id
        first_turn, second_turn, short_ttft, same = [], [], [], True
        for _ in range(args.repeats):
            client.completions.create(model=model, prompt="Unrelated.", max_tokens=1)  # the cache holds another text
            short_ttft.append(first_token_s(client.completions, model, prompt=SHORT, max_tokens=2)[0])
            seconds, answer = first_token_s(client.chat.completions, model, messages=turn1, max_tokens=24)
            first_turn.append(seconds)
            same &= answer == expected
            turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And Monday?"}]
            second_turn.append(first_token_s(client.chat.completions, model, messages=turn2, max_tokens=24)[0])
    report = {
        "run": str(args.run), "prompt_tokens": prompt_tokens, "repeats": args.repeats,
        "prefill_s": round(statistics.median(prefill), 4),
        "first_turn_ttft_s": round(statistics.median(first_turn), 4),
        "short_prompt_prefill_s": round(statistics.median(short_prefill), 4),
        "short_prompt_ttft_s": round(statistics.median(short_ttft), 4),
        "overhead_ms": round(1000 * (statistics.median(short_ttft) - statistics.median(short_prefill)), 1),
        "second_turn_ttft_s": round(statistics.median(second_turn), 4),
        "second_over_first": round(statistics.median(second_turn) / statistics.median(first_turn), 3),
        "greedy_as_generate": same,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
