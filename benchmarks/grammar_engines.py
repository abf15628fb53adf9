"""Which grammar engine constrains the server's JSON: llguidance, xgrammar and outlines-core measured on one tokenizer.

    python -m benchmarks.grammar_engines --tokenizer <folder with tokenizer.json> --out docs/results/grammar-engines.json

For each engine and each of the 20 schemas of ``benchmarks/data/json_schemas.json`` (objects, arrays, enums, patterns,
nesting, anyOf): the time to compile the schema against the tokenizer, then the valid example instance fed token by
token (its tokenizer's own tokens, then end of text) as generation feeds it: per token, the engine fills the bitmask
of allowed tokens, the mask is applied to a row of logits (one shared numpy/torch step for every engine, so only the
engine's part differs), and the token is consumed. Counted: the examples every token of which was allowed and that
ended accepted; the tokenizer's preparation once.

Only llguidance is the project's dependency (the server's); the others are measured from a side folder, never
installed into the project:

    pip download --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 outlines-core==0.2.14 -d /tmp/g
    pip install --no-deps --target /tmp/g/site /tmp/g/*.whl
    PYTHONPATH=/tmp/g/site python -m benchmarks.grammar_engines --tokenizer ... --out ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from exporters.runtime.constraint import JSON_OPTIONS, apply_bitmask

SCHEMAS = Path(__file__).resolve().parent / "data" / "json_schemas.json"
SEPARATORS = (", ", ": ")  # json.dumps' defaults: the examples are written so, every engine takes them


class Engine:
    name = ""

    def prepare(self, tokenizer_json: str, vocab: int, eos: int) -> None:
        raise NotImplementedError

    def compile(self, schema: dict[str, Any]) -> Any:
        raise NotImplementedError

    def fill(self, state: Any, bitmask: np.ndarray) -> None:
        raise NotImplementedError

    def consume(self, state: Any, token: int) -> bool:
        raise NotImplementedError

    def accepting(self, state: Any) -> bool:
        raise NotImplementedError


class LLGuidance(Engine):
    name = "llguidance"

    def prepare(self, tokenizer_json: str, vocab: int, eos: int) -> None:
        import llguidance

        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        matcher = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(self, state: Any, bitmask: np.ndarray) -> None:
        state.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def consume(self, state: Any, token: int) -> bool:
        return state.consume_token(token)

    def accepting(self, state: Any) -> bool:
        return state.is_stopped() and not state.is_error()


class XGrammar(Engine):
    name = "xgrammar"

    def prepare(self, tokenizer_json: str, vocab: int, eos: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
        from tokenizers import Tokenizer

        self.xg = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.xg.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                       separators=SEPARATORS))

    def fill(self, state: Any, bitmask: np.ndarray) -> None:
        state.fill_next_token_bitmask(torch.from_numpy(bitmask))

    def consume(self, state: Any, token: int) -> bool:
        return state.accept_token(token)

    def accepting(self, state: Any) -> bool:
        return state.is_terminated()


class OutlinesCore(Engine):
    name = "outlines-core"

    def prepare(self, tokenizer_json: str, vocab: int, eos: int) -> None:
        import outlines_core
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.oc = outlines_core
        spec = json.loads(tokenizer_json)
        to_byte = {c: b for b, c in bytes_to_unicode().items()}  # byte-level BPE's printable stand-ins
        tokens: dict[bytes, list[int]] = {}
        for text, index in spec["model"]["vocab"].items():
            if index != eos:
                tokens.setdefault(bytes(to_byte[c] for c in text), []).append(index)
        self.vocabulary, self.eos = outlines_core.Vocabulary(eos, tokens), eos

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern=" ?")
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def fill(self, state: Any, bitmask: np.ndarray) -> None:
        state.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)

    def consume(self, state: Any, token: int) -> bool:
        if token != self.eos:  # end of text is allowed in a final state, not a transition out of it
            state.advance(token, return_tokens=False)
        return True

    def accepting(self, state: Any) -> bool:
        return state.is_finished()


ENGINES: dict[str, Callable[[], Engine]] = {"llguidance": LLGuidance, "xgrammar": XGrammar,
                                            "outlines-core": OutlinesCore}


def measure(engine: Engine, cases: list[dict[str, Any]], tokenizer, vocab: int, eos: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    engine.prepare(tokenizer.to_str(), vocab, eos)
    prepare_s = time.perf_counter() - start
    compile_ms, per_token_us, fill_us, accepted, failures = [], [], [], 0, []
    logits = torch.zeros(vocab)
    for case in cases:
        start = time.perf_counter()
        state = engine.compile(case["schema"])
        compile_ms.append((time.perf_counter() - start) * 1e3)
        ids = tokenizer.encode(json.dumps(case["example"], separators=SEPARATORS)).ids + [eos]
        ok = True
        for token in ids:
            bitmask = np.full((vocab + 31) // 32, -1, dtype=np.int32)
            start = time.perf_counter()
            engine.fill(state, bitmask)
            fill_us.append((time.perf_counter() - start) * 1e6)
            masked = apply_bitmask(torch.from_numpy(logits.numpy().copy()), bitmask)
            allowed = bool(masked[token] == 0)
            engine.consume(state, token)
            per_token_us.append((time.perf_counter() - start) * 1e6)
            if not allowed:
                ok = False
                failures.append(f"{case['name']}: token {token} refused")
                break
        if ok and engine.accepting(state):
            accepted += 1
    per_token_us.sort()
    return {"prepare_s": round(prepare_s, 3), "compile_ms_median": round(statistics.median(compile_ms), 2),
            "compile_ms_max": round(max(compile_ms), 2), "compile_ms_total": round(sum(compile_ms), 1),
            "mask_us_median": round(statistics.median(per_token_us), 1),
            "mask_us_p99": round(per_token_us[int(0.99 * (len(per_token_us) - 1))], 1),
            "mask_us_mean": round(statistics.fmean(per_token_us), 1), "tokens": len(per_token_us),
            "fill_us_median": round(statistics.median(fill_us), 1), "fill_us_mean": round(statistics.fmean(fill_us), 1),
            "examples_accepted": accepted, "examples": len(cases), "failures": failures[:5]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a folder holding tokenizer.json and config.json")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--repeats", type=int, default=3, help="each engine measured this many times; the best kept")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    config = json.loads((args.tokenizer / "config.json").read_text())
    vocab, eos = config["vocab_size"], config["eos_token_id"]
    cases = json.loads(SCHEMAS.read_text())
    results: dict[str, Any] = {}
    for name in args.engines.split(","):
        try:
            runs = [measure(ENGINES[name](), cases, tokenizer, vocab, eos) for _ in range(args.repeats)]
        except ImportError as e:
            results[name] = {"missing": str(e)}
            continue
        results[name] = {**min(runs, key=lambda r: r["mask_us_mean"]), "version": metadata.version(name)}
        print(name, json.dumps(results[name]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tokenizer": str(args.tokenizer.name), "vocab": vocab, "schemas": len(cases),
                                    "engines": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
