"""``python -m exporters.generate`` as a user types it: a prompt is text, every key of the usage text works, and what
the program can answer without its weights is refused before they are loaded."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from exporters.errors import UserError
from exporters.generate import USAGE, parse
from tests.helpers import REPO_ROOT

# Each of these was mangled or refused when prompts were read as YAML (OmegaConf's dotlist).
HOSTILE = {
    "colon": "Question: what is 2+2?",
    "hash": "x # comment",
    "interpolation": "cost is ${price}",
    "code": "def quicksort(xs):\n    if not xs: return []  # done\n    pivot, *rest = xs\n    return {'a': [pivot]}\n",
    "yaml list": "- item\n- [unclosed",
    "equals": "a=b, c = d",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_prompt_is_taken_as_written(name: str, tmp_path: Path) -> None:
    text = HOSTILE[name]
    assert parse(["run", f"prompt={text}"])[1].prompt == text
    file = tmp_path / "prompt.txt"
    file.write_text(text, encoding="utf-8")
    assert parse(["run", f"prompt_file={file}"])[1].prompt == text
    assert parse(["run", "prompt=-"], stdin=io.StringIO(text))[1].prompt == text


@pytest.mark.parametrize("argv, says", [
    (["run"], "no prompt: give prompt=<text>, prompt_file=<path> or prompt=-"),
    (["run", "prompt=a", "prompt=b"], "prompt= is given 2 times"),
    (["run", "prompt=a", "prompt_file=p.txt"], "prompt= and prompt_file= are both given"),
    (["run", "prompt_file=/no/such/prompt.txt"], "prompt_file=/no/such/prompt.txt: cannot be read"),
    (["run", "prompt=a", "max_new_tokens=many"], "max_new_tokens"),
    (["run", "prompt=a", "promt=b"], "promt"),
    (["run", "promt=b"], "promt"),  # a mistyped key is named, not taken for a missing prompt
])
def test_argument_mistakes_are_one_message(argv: list[str], says: str) -> None:
    with pytest.raises(UserError, match=re.escape(says)):
        parse(argv)


def test_every_key_the_usage_text_names_is_accepted(tmp_path: Path) -> None:
    """Each ``key=`` of the usage text parses with a value of its kind (the usage cannot name a key that fails)."""
    (tmp_path / "p.txt").write_text("Once upon a time")
    samples = {"prompt": "Once: upon # a ${time}", "prompt_file": str(tmp_path / "p.txt"), "max_new_tokens": "5",
               "temperature": "0.7", "top_p": "0.9", "seed": "3", "chat": "true", "tokenizer": "/a b/tok.json",
               "adapter": "adapters/legal.ptd", "speculative": "lookup", "draft_tokens": "2", "image": "a #1.png",
               "verbose": "true", "audio": "a #1: talk.wav", "language": "fr", "task": "translate",
               "json_schema": "/a b/schema #1.json"}
    named = set(re.findall(r"\b([a-z_]+)=", USAGE.split("keys:", 1)[1]))  # the keys, not the synopsis
    assert named <= samples.keys(), named - samples.keys()
    for key in named:
        base = [] if key in ("prompt", "prompt_file", "audio") else ["prompt=x"]
        _, args = parse(["run", *base, f"{key}={samples[key]}"])
        value = getattr(args, "prompt" if key == "prompt_file" else key)
        expected = (tmp_path / "p.txt").read_text() if key == "prompt_file" else samples[key]
        assert str(value).lower() == expected.lower() or value == [expected], (key, value)


def generate(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "exporters.generate", *args], input=stdin, capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=600)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.mark.slow
def test_a_multi_line_code_prompt_from_standard_input_generates_as_the_library_does(exported, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The prompt read from standard input as written, the answer constrained to a JSON schema (json_schema=): what
    the library writes with the same constraint, and it validates."""
    import jsonschema

    from exporters.runtime.generator import Generator, SamplingConfig

    pte = exported().pte_path
    prompt = HOSTILE["code"]
    (tmp_path / "schema #1.json").write_text(json.dumps(SCHEMA))
    proc = generate(str(pte.parent), "prompt=-", "max_new_tokens=60", f"json_schema={tmp_path / 'schema #1.json'}",
                    stdin=prompt)
    assert proc.returncode == 0, proc.stderr
    generator = Generator(pte)
    expected = generator.generate(prompt, SamplingConfig(max_new_tokens=60),
                                  constraint=generator.grammars.json_schema(SCHEMA)).text
    assert proc.stdout.startswith(prompt + expected) and "stopped: eos" in proc.stderr
    jsonschema.validate(json.loads(expected), SCHEMA)


@pytest.mark.slow
def test_a_schema_that_cannot_be_read_or_used_is_refused_before_loading(exported, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from exporters.generate import constraint_of
    from exporters.runtime.generator import Generator

    generator = Generator(exported().pte_path, load=False)
    (tmp_path / "bad.json").write_text('{"type": "objekt"}')
    (tmp_path / "good.json").write_text(json.dumps(SCHEMA))
    for args, says in ((["json_schema=" + str(tmp_path / "none.json")], "cannot be read as a JSON file"),
                       (["json_schema=" + str(tmp_path / "bad.json")], "the JSON schema cannot be used: Invalid type"),
                       (["json_schema=" + str(tmp_path / "good.json"), "speculative=lookup"],
                        "json_schema= chooses one token per call")):
        with pytest.raises(UserError, match=says):
            constraint_of(generator, parse(["run", "prompt=x", *args])[1])


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["speculative=draft"], "speculative=draft needs a draft model"),
    (["speculative=lookup"], "speculative=lookup needs the program's verify method"),
    (["image=docs/cost_curve.png"], "image= needs a vision-language program"),
])
def test_what_the_program_cannot_do_is_refused_in_one_message(exported, args: list[str], says: str,  # type: ignore[no-untyped-def]
                                                                capsys) -> None:
    # In this process (a child process costs 8 s of imports each; the stdin test above runs the command itself).
    from exporters.generate import main

    assert main([str(exported().pte_path.parent), "prompt=Once upon a time", *args]) == 2
    out, err = capsys.readouterr()
    assert says in err and "Traceback" not in err
    assert out == ""  # refused before the prompt is echoed: nothing was generated
