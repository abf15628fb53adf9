"""Constrained JSON on a real program: is every answer valid, and what does the grammar cost in tokens/s?

    python -m benchmarks.constrained outputs/smollm2 --out docs/results/constrained-smollm2.json

For each of the 20 schemas of ``benchmarks/data/json_schemas.json``: its prompt, through the program's chat
template, answered greedily with the schema as ``response_format`` would constrain it
(``exporters.runtime.constraint``), then the same prompt unconstrained. Counted: answers that parse and validate
(``jsonschema``) and end by themselves (not cut by ``--max-tokens``); decode tokens/s of each, summed over the
schemas (tokens over seconds), the unconstrained answer cut to the constrained one's length (the same positions, so
the same cost per step from the program): their ratio is the grammar's cost per token (mask, apply, consume).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.grammar_engines import SCHEMAS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run folder with a chat template beside its program")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import jsonschema

    from exporters import console
    from exporters.runtime.generator import Generator, SamplingConfig, chat_prompt

    with console.native_stderr_to(None):
        generator = Generator(args.run)
    cases = json.loads(SCHEMAS.read_text())
    start = time.perf_counter()
    generator.grammars.json_schema(None)  # the engine's tokenizer, made once per program
    tokenizer_s = time.perf_counter() - start
    rows: list[dict[str, Any]] = []
    for case in cases:
        prompt = chat_prompt(generator.pte, case["prompt"] + " Answer in JSON.")
        cfg = SamplingConfig(args.max_tokens, 0.0, 1.0, 0)
        start = time.perf_counter()
        constraint = generator.grammars.json_schema(case["schema"])
        compile_s = time.perf_counter() - start
        constrained = generator.generate(prompt, cfg, speculative="none", constraint=constraint)
        # As many tokens unconstrained (fewer only if it ends first): the same positions, so the same cost a step.
        plain = generator.generate(prompt, SamplingConfig(max(1, len(constrained.new_ids)), 0.0, 1.0, 0),
                                   speculative="none")
        try:
            jsonschema.validate(json.loads(constrained.text), case["schema"])
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
        rows.append({"schema": case["name"], "valid": valid, "ended": constrained.stop_reason == "eos",
                     "tokens": len(constrained.new_ids), "tok_s": round(constrained.generation_tokens_per_s, 1),
                     "plain_tokens": len(plain.new_ids), "plain_tok_s": round(plain.generation_tokens_per_s, 1),
                     "compile_ms": round(compile_s * 1e3, 2), "answer": constrained.text})
        print(f"{case['name']:20s} valid={valid!s:5s} {rows[-1]['tokens']:4d} tokens {rows[-1]['tok_s']:7.1f} tok/s "
              f"(plain {rows[-1]['plain_tok_s']:7.1f})  {constrained.text[:80]!r}", flush=True)

    def rate(tokens: str, speed: str) -> float:  # tokens over seconds, summed over the schemas
        return sum(r[tokens] for r in rows) / sum(r[tokens] / r[speed] for r in rows if r[speed])

    summary = {"schemas": len(rows), "valid": sum(r["valid"] for r in rows), "ended": sum(r["ended"] for r in rows),
               "tok_s": round(rate("tokens", "tok_s"), 1), "plain_tok_s": round(rate("plain_tokens", "plain_tok_s"), 1),
               "engine_tokenizer_s": round(tokenizer_s, 3)}
    summary["ratio"] = round(summary["tok_s"] / summary["plain_tok_s"], 3)
    print(json.dumps(summary))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"run": args.run.name, "max_tokens": args.max_tokens, "summary": summary,
                                    "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
