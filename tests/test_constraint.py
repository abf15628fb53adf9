"""The grammar engine's side of constrained decoding, on the tiny tokenizer (no program): what a schema lets a model
write. The answers themselves are tested through the server and exporters.generate (test_serve, test_generate_cli)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from exporters.runtime.constraint import NUMBER_LIMIT, Grammars, bounded_numbers


def writes(constraint, tokenizer, text: str) -> bool:  # type: ignore[no-untyped-def]
    """Whether the grammar lets ``text`` be written token by token, and the document is then complete."""
    for token in tokenizer.encode(text, add_special_tokens=False).ids:
        if constraint.allow(torch.zeros(1, constraint.bitmask.size * 32))[0, token] != 0:
            return False
        constraint.consume(token)
    return constraint.matcher.is_accepting()


@pytest.mark.parametrize("schema, text, allowed", [
    ({"type": "number"}, "0.833333333", True),
    ({"type": "number"}, "0.8333333333", False),  # a tenth decimal: the digits a small model runs on with
    ({"type": "integer"}, str(NUMBER_LIMIT), True),
    ({"type": "integer"}, str(NUMBER_LIMIT + 1), False),
    ({"type": "integer", "maximum": 10**17}, str(10**17), True),  # the schema's own bound is kept
    ({"type": "number", "multipleOf": 0.5}, "-2.5", True),
    ({"type": "array", "items": {"type": "number"}}, "[1, 2.25, -3]", True),
    (None, '{"a": [1, {"b": null}], "c": 0.5}', True),  # json_object
    (None, '{"a": 10000000000000000}', False),
])
def test_numbers_a_schema_leaves_unbounded_end(tiny_checkpoint: Path, schema, text: str, allowed: bool) -> None:  # type: ignore[no-untyped-def]
    """A number the schema does not bound has at most 15 integral digits and 9 decimals, so digits cannot run to the
    token budget; what the schema bounds keeps its bounds, and what the grammar allows validates against the schema as
    the client gave it."""
    from tokenizers import Tokenizer

    tokenizer_file = tiny_checkpoint / "tokenizer.json"
    constraint = Grammars(tokenizer_file, None, {2}).json_schema(schema)
    assert writes(constraint, Tokenizer.from_file(str(tokenizer_file)), text) == allowed
    if allowed and schema is not None:
        jsonschema.validate(json.loads(text), schema)


def test_bounding_leaves_the_clients_schema_and_its_values_alone() -> None:
    """Bounds go where a schema leaves numbers open, found by the keywords that hold schemas (so properties named
    "type" or "default" are schemas and get them, while values under "default" or "enum" are data); a schema listing
    its values, or bounded on both sides, keeps what it says."""
    number = {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT, "multipleOf": 1e-9}
    schema = {"type": "object", "properties": {"type": {"type": "number"}, "default": {"type": "number"},
                                               "n": {"type": ["integer", "null"], "minimum": 5},
                                               "pick": {"type": "integer", "enum": [10**16, 3]},
                                               "pi": {"type": "number", "const": 3.14159265358979},
                                               "tiny": {"type": "number", "exclusiveMinimum": 0,
                                                        "exclusiveMaximum": 1e-10}},
              "$defs": {"x": {"type": "array", "items": {"type": "number"}}},
              "anyOf": [{"type": "number"}], "default": {"type": "integer"}}
    given = json.dumps(schema)
    bounded = bounded_numbers(schema)
    assert json.dumps(schema) == given
    props = bounded["properties"]
    assert props["type"] == number and props["default"] == number and bounded["anyOf"] == [number]
    assert bounded["$defs"]["x"]["items"] == number
    assert props["n"] == {"type": ["integer", "null"], "minimum": 5, "maximum": NUMBER_LIMIT}
    assert props["pick"] == schema["properties"]["pick"] and props["pi"] == schema["properties"]["pi"]
    assert props["tiny"] == schema["properties"]["tiny"]  # too narrow a range for multiples of 1e-9
    assert bounded_numbers({"type": "number", "minimum": 0, "maximum": 1})["multipleOf"] == 1e-9  # 0.8333... ends
    assert bounded["default"] == schema["default"]
    assert bounded_numbers({"type": "integer", "minimum": 10**17}) == {"type": "integer", "minimum": 10**17}
