"""Constrained decoding: only the tokens a JSON schema allows next may be chosen, so every answer parses and validates.

The grammar engine is llguidance (chosen by measurement against xgrammar and outlines-core:
``benchmarks.grammar_engines``, docs/serving.md). It reads the program's own ``tokenizer.json`` and, at each step,
fills a bitmask of the tokens that keep the text a prefix of some valid document; the mask is applied to the
logits the token is chosen from (greedy or sampled alike), and the chosen token is consumed. When the document is
complete and nothing may follow, generation ends there (the end-of-text token the mask would force is not run).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exporters.errors import UserError

#: The JSON the engine writes: json.dumps' separators, no other whitespace (a small model let loose on whitespace
#: can write newlines until its token budget ends).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: Numbers a schema leaves unbounded are written with at most 15 integral digits and 9 decimals (no exponent): a
#: small model can write digits until its budget ends (``0.8333...``), and JSON has no bound of its own. Bounds are
#: added only where the schema sets none, so every answer still validates against the schema as given.
NUMBER_LIMIT = 10**15 - 1
DECIMALS = 1e-9
# Where a JSON schema keeps other schemas: keyword -> a map of them, a list of them, or one.
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
SCHEMA_LISTS = frozenset({"anyOf", "allOf", "oneOf", "prefixItems"})
SCHEMA_ONE = frozenset({"items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
                        "propertyNames", "unevaluatedItems", "unevaluatedProperties"})
#: Any JSON object (``response_format={"type": "json_object"}``), its numbers bounded as above.
ANY_OBJECT: dict[str, Any] = {
    "$defs": {"value": {"anyOf": [{"type": "number"}, {"type": "string"}, {"type": "boolean"}, {"type": "null"},
                                  {"type": "array", "items": {"$ref": "#/$defs/value"}},
                                  {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}}]}},
    "type": "object", "additionalProperties": {"$ref": "#/$defs/value"}}


def bounded_numbers(schema: Any) -> Any:
    """``schema`` with every ``number``/``integer`` it leaves unbounded given :data:`NUMBER_LIMIT` (and numbers
    :data:`DECIMALS`, unless their range is too narrow for it); a bound the schema sets is kept, and a schema that
    lists its values (``enum``, ``const``) is left as it is. A new structure: the caller's schema is not changed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: bounded_numbers(sub) for name, sub in value.items()}
        elif key in SCHEMA_LISTS and isinstance(value, list) or key == "items" and isinstance(value, list):
            out[key] = [bounded_numbers(sub) for sub in value]
        elif key in SCHEMA_ONE:
            out[key] = bounded_numbers(value)
    kinds = out.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    if not kinds & {"number", "integer"} or "enum" in out or "const" in out:
        return out
    low, high = out.get("minimum", out.get("exclusiveMinimum")), out.get("maximum", out.get("exclusiveMaximum"))
    # Decimals run on inside a bounded range too (a confidence in [0, 1]: 0.8333...); a range too narrow for many
    # multiples of DECIMALS keeps its own.
    if "number" in kinds and "multipleOf" not in out and (low is None or high is None or high - low >= 1e3 * DECIMALS):
        out["multipleOf"] = DECIMALS
    if low is None and (high is None or high > -NUMBER_LIMIT):
        out["minimum"] = -NUMBER_LIMIT
    if high is None and (low is None or low < NUMBER_LIMIT):
        out["maximum"] = NUMBER_LIMIT
    return out


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """``logits`` (last dimension: the vocabulary) with every token whose bit is 0 in ``bitmask`` (int32 words, 32
    tokens each, lowest bit first) set to -inf, in place (a contiguous float32 CPU tensor)."""
    bits = np.unpackbits(bitmask.view(np.uint8), count=logits.shape[-1], bitorder="little")  # zeros past the mask
    # In numpy, on this thread: torch's intra-op threads cost 10-20 ms per call when the cores are busy; copyto is
    # 3x faster than a boolean index (40 against 130 us for 49k tokens).
    np.copyto(logits.numpy(), np.float32(-np.inf), where=~bits.view(np.bool_))
    return logits


class Constraint:
    """One answer's grammar state: :meth:`allow` masks the logits, :meth:`consume` takes the chosen token."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        self.matcher = matcher
        self.bitmask = np.empty((vocab + 31) // 32, dtype=np.int32)  # tokens past it (padding rows) are never allowed

    def allow(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` with the tokens the grammar does not allow next at -inf."""
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
        return apply_bitmask(torch.from_numpy(logits.float().numpy().copy()), self.bitmask)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):  # the mask allowed it: only a bug gets here
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The document is whole and nothing may follow it."""
        return self.matcher.is_stopped()


class Grammars:
    """Constraints for one program's tokenizer. The engine's tokenizer is made once, at first use (about 0.3 s for a
    49k vocabulary); each schema compiles in about a millisecond."""

    def __init__(self, tokenizer_json: Path | None, vocab: int | None, eos_ids: set[int]) -> None:
        """``vocab``: the program's logits width (get_vocab_size); None: the tokenizer's."""
        self.tokenizer_json, self.vocab, self.eos_ids = tokenizer_json, vocab, sorted(eos_ids)
        self._tokenizer = None
        self._added: set[str] = set()  # the added tokens' text, read with the tokenizer
        self._lock = threading.Lock()

    def _engine_tokenizer(self):  # type: ignore[no-untyped-def]
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                if self.tokenizer_json is None or not self.tokenizer_json.is_file():
                    raise UserError("constrained decoding needs the program's tokenizer.json beside it (a SentencePiece "
                                    "tokenizer.model alone is not read by the grammar engine).")
                text = self.tokenizer_json.read_text()
                self._added = {token.get("content") for token in json.loads(text).get("added_tokens", [])}
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab, eos_token=self.eos_ids or None)
            return self._tokenizer

    def json_schema(self, schema: dict[str, Any] | None) -> Constraint:
        """A constraint to a JSON document valid against ``schema`` (None: any JSON object), its unbounded numbers
        bounded (:func:`bounded_numbers`). An invalid or unsupported schema is a UserError with the engine's reason."""
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(bounded_numbers(ANY_OBJECT if schema is None else schema)), defaults=JSON_OPTIONS)
        except ValueError as e:
            raise UserError(f"the JSON schema is not a JSON object: {e}") from None
        return self._constraint(grammar)

    def tagged(self, schema: dict[str, Any], opening: str, closing: str) -> Constraint:
        """Free text in which any ``opening`` ... ``closing`` span holds a JSON document valid against ``schema``
        (a model's own tool-call syntax, e.g. Qwen's ``<tool_call>`` tags): the grammar applies from the moment the
        model writes ``opening``. Tags that are single tokens of the tokenizer are matched as those tokens."""
        import llguidance

        document = json.dumps({**bounded_numbers(schema), "x-guidance": JSON_OPTIONS})
        self._engine_tokenizer()  # reads the added tokens too
        if {opening, closing} <= self._added:  # added tokens: not text the lexer can match
            call = f'call: TEXT {opening} "\\n" %json {document} "\\n" {closing}'
        else:
            call = (f"call_opening[lazy]: TEXT {json.dumps(opening)}\n"
                    f'call: call_opening "\\n" %json {document} {json.dumps(chr(10) + closing)}')
        lark = f"%llguidance {{}}\nstart: call* TEXT\nTEXT: /(.|\\n)*/\n{call}\n"
        return self._constraint(llguidance.LLMatcher.grammar_from_lark(lark))

    def _constraint(self, grammar: str) -> Constraint:
        import llguidance

        tokenizer = self._engine_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise UserError(f"the JSON schema cannot be used: {matcher.get_error()}")
        return Constraint(matcher, tokenizer.vocab_size)
