"""``python -m exporters.serve`` as its users reach it: the official ``openai`` client, ``curl``-style raw HTTP and
many clients at once, against a real server process over real programs (the tiny default, the real SmolLM2 for its
chat template, a swappable-adapter program). Greedy answers are the ones ``exporters.generate`` gives."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Iterator, Literal

import pydantic
import pytest

from benchmarks.server_process import Server, serving
from exporters.runtime.generator import Generator, SamplingConfig, chat_prompt

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tiny_server(exported, tmp_path_factory) -> Iterator[tuple[Server, Path]]:  # type: ignore[no-untyped-def]
    run = exported().pte_path.parent
    with serving(run, tmp_path_factory.mktemp("serve") / "serve.log", "max_queue=4") as server:
        yield server, run


def greedy(run: Path, prompt: str, tokens: int, adapter: str | None = None) -> str:
    """What exporters.generate writes for ``prompt``, greedily."""
    return Generator(run, adapter=adapter).generate(prompt, SamplingConfig(tokens, 0.0, 1.0, 0)).text


def test_completions_are_what_generate_writes_streamed_or_not(tiny_server) -> None:  # type: ignore[no-untyped-def]
    server, run = tiny_server
    client = server.client()
    assert [m.id for m in client.models.list().data] == [run.name]
    expected = greedy(run, "Once upon a time", 24)
    whole = client.completions.create(model=run.name, prompt="Once upon a time", max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24 and whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    pieces = list(client.completions.create(model=run.name, prompt="Once upon a time", max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in pieces if c.choices) == expected
    assert pieces[-1].usage.completion_tokens == 24 and len([c for c in pieces if c.choices]) > 3
    # The same prompt again: all but its last token are in the cache, and the answer does not change.
    assert pieces[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1


def test_the_next_turn_runs_only_its_new_tokens(tiny_server) -> None:  # type: ignore[no-untyped-def]
    server, run = tiny_server
    client = server.client()
    first = client.completions.create(model=run.name, prompt="Hello world!", max_tokens=12, temperature=0)
    follow = "Hello world!" + first.choices[0].text + " And then"
    second = client.completions.create(model=run.name, prompt=follow, max_tokens=12, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + 8
    assert second.choices[0].text == greedy(run, follow, 12)  # exactly what a fresh cache gives
    other = client.completions.create(model=run.name, prompt="Good morning", max_tokens=12, temperature=0)
    assert other.choices[0].text == greedy(run, "Good morning", 12)


def test_sampling_is_seeded_and_stop_strings_cut_the_text(tiny_server) -> None:  # type: ignore[no-untyped-def]
    server, run = tiny_server
    client = server.client()
    ask = dict(model=run.name, prompt="Once upon a time", max_tokens=20, temperature=1.0, top_p=0.9)
    a, b = (client.completions.create(seed=7, **ask).choices[0].text for _ in range(2))
    assert a == b
    full = greedy(run, "Once upon a time", 24)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.completions.create(model=run.name, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=run.name, prompt="Once upon a time", max_tokens=24, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[:full.index(stop)]


def test_log_probabilities_are_the_programs_own(tiny_server) -> None:  # type: ignore[no-untyped-def]
    """logprobs=3 on a text completion: one entry per completion token, each the log-softmax of the logits the
    program gave at that position (recomputed here through the program's own methods), the greedy token the best of
    its three alternatives; streamed, the same numbers arrive with the last chunk."""
    import torch

    from exporters.runtime.driver import Driver
    from exporters.runtime.programs import LoadedProgram

    server, run = tiny_server
    client = server.client()
    ask = dict(model=run.name, prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=3)
    whole = client.completions.create(**ask).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == whole.text and lp.text_offset[1] == len(lp.tokens[0])
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) <= 3 and value == max(top.values()) and top[chosen] == value
    plain = Generator(run).generate("Once upon a time", SamplingConfig(12, 0.0, 1.0, 0))  # the same greedy tokens
    ids, new = plain.prompt_ids, plain.new_ids
    driver = Driver.of(LoadedProgram(run / "model.pte"))
    logits = driver.prefill(torch.tensor([ids]))
    expected = []
    for i, token in enumerate(new[:4]):  # the first four positions, through the program itself
        expected.append(float(torch.log_softmax(logits.float().reshape(-1), dim=-1)[token]))
        logits = driver.decode_one_token(token, len(ids) + i)
    assert lp.token_logprobs[:4] == pytest.approx(expected, abs=1e-5)
    chunks = list(client.completions.create(stream=True, **ask))
    # (the prompt is in the cache now: its last token runs alone, not in prefill, so equal to float noise)
    assert chunks[-1].choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert chunks[-1].choices[0].logprobs.tokens == lp.tokens
    assert all(c.choices[0].logprobs is None for c in chunks[:-1])


# Schemas of benchmarks/data/json_schemas.json whose every value is bounded (enums, booleans, integers in a range,
# strings of a most length, patterns): the tiny random model's answer ends within its token budget. A string without
# maxLength can go on until the budget ends (numbers are bounded by the engine: tests/test_constraint.py).
BOUNDED = ("person", "task", "keywords", "color", "rating")


def schema_case(name: str) -> dict:  # type: ignore[type-arg]
    from benchmarks.grammar_engines import SCHEMAS

    return next(c for c in json.loads(SCHEMAS.read_text()) if c["name"] == name)


def as_format(case: dict) -> dict:  # type: ignore[type-arg]
    return {"type": "json_schema", "json_schema": {"name": case["name"], "schema": case["schema"]}}


def test_a_json_schema_answer_parses_validates_and_is_the_best_allowed_token_each_time(tiny_server) -> None:  # type: ignore[no-untyped-def]
    """response_format with a JSON schema: every answer parses and validates, streamed or not, and is what the library
    gives (Generator.generate with the constraint); each greedy token is the program's best among those the grammar
    allows, checked through the program's own methods and a grammar stepped here."""
    import jsonschema
    import torch

    from exporters.runtime.driver import Driver
    from exporters.runtime.programs import LoadedProgram

    server, run = tiny_server
    client = server.client()
    answers = {}
    for name in BOUNDED:
        case = schema_case(name)
        got = client.completions.create(model=run.name, prompt="Once upon a time", max_tokens=100, temperature=0,
                                        extra_body={"response_format": as_format(case)}).choices[0]
        assert got.finish_reason == "stop", (name, got.text)
        jsonschema.validate(json.loads(got.text), case["schema"])
        answers[name] = got.text
    case = schema_case("person")
    streamed = client.completions.create(model=run.name, prompt="Once upon a time", max_tokens=100, temperature=0,
                                         stream=True, extra_body={"response_format": as_format(case)})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == answers["person"]
    generator = Generator(run)
    library = generator.generate("Once upon a time", SamplingConfig(100, 0.0, 1.0, 0),
                                 constraint=generator.grammars.json_schema(case["schema"]))
    assert library.text == answers["person"] and library.stop_reason == "eos"
    # Independently: the program's logits, the grammar's allowed tokens, the argmax among them, step by step.
    grammar = generator.grammars.json_schema(case["schema"])
    driver = Driver.of(LoadedProgram(run / "model.pte"))
    ids = library.prompt_ids
    logits = driver.prefill(torch.tensor([ids]))
    for i, token in enumerate(library.new_ids):
        assert token == int(grammar.allow(logits).reshape(-1).argmax()), f"token {i}"
        grammar.consume(token)
        logits = driver.decode_one_token(token, len(ids) + i)
    assert grammar.complete
    sampled = client.completions.create(model=run.name, prompt="Once upon a time", max_tokens=100, temperature=1.0,
                                        seed=3, extra_body={"response_format": {"type": "json_object"}}).choices[0]
    if sampled.finish_reason == "stop":  # an object of any keys: its strings may run to the budget
        assert isinstance(json.loads(sampled.text), dict)
    else:
        assert sampled.text.startswith("{")


@pytest.mark.parametrize("body, status, says", [
    (b'{"model": "x", "prompt": ', 400, "not valid JSON"),
    (b'{"model": "nope", "prompt": "a"}', 404, "model 'nope' is not served here"),
    (b'{"model": "M", "prompt": "a", "logprobs": 9}', 400, "logprobs=9: a text completion takes the number of"),
    (b'{"model": "M", "prompt": "a", "top_logprobs": 2}', 400, "top_logprobs is a chat completion's field"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "logprobs": 2}', 400,
     "a chat completion takes logprobs=true and the number of alternatives as top_logprobs"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', 400,
     "top_logprobs needs logprobs=true"),
    (b'{"model": "M", "prompt": "a", "temprature": 0}', 400, "temprature: not a field of this request"),
    (b'{"model": "M", "prompt": "a", "n": 2}', 400, "n=2: this server gives one answer per request"),
    (b'{"model": "M", "prompt": "a", "max_tokens": 100000}', 400, "max_tokens=100000 is above this server's limit"),
    (b'{"model": "M", "prompt": "' + b"word " * 600 + b'"}', 400, "the prompt is"),
    (b'{"model": "M", "prompt": "a", "response_format": {"type": "json_schema"}}', 400, "needs json_schema.schema"),
    (b'{"model": "M", "prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
     b'"schema": {"type": "objekt"}}}}', 400, "the JSON schema cannot be used: Invalid type: objekt"),
    (b'{"model": "M", "prompt": "a", "response_format": {"type": "xml"}}', 400, "one of 'text', 'json_object'"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
     b'{"name": "f"}}]}', 400, "tool_choice=auto (the default with tools)"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
     b'{"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}', 400, "naming one of the tools (f)"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}]}', 400, "without a chat template"),
])
def test_a_bad_request_is_one_json_error_and_the_server_goes_on(tiny_server, body: bytes, status: int,  # type: ignore[no-untyped-def]
                                                                says: str) -> None:
    server, run = tiny_server
    path = "/chat/completions" if b"messages" in body else "/completions"
    code, _, answer = server.raw(path, body.replace(b'"M"', json.dumps(run.name).encode()))
    assert code == status and says in answer["error"]["message"], answer
    assert server.raw("/completions", json.dumps({"model": run.name, "prompt": "a", "max_tokens": 2}).encode())[0] == 200


def test_curl_gets_an_answer_a_stream_and_an_error(tiny_server) -> None:  # type: ignore[no-untyped-def]
    """The curl command a user types (docs/serving.md): the answer generate gives, the stream as server-sent events
    ending in [DONE], and a malformed body as one JSON error with its status."""
    import shutil
    import subprocess

    from benchmarks.server_process import KEY

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    server, run = tiny_server

    def curl(body: str) -> str:
        return subprocess.run(["curl", "-sN", "-w", "\n%{http_code}", f"{server.url}/completions", "-H",
                               "Content-Type: application/json", "-H", f"Authorization: Bearer {KEY}", "-d", body],
                              capture_output=True, text=True, timeout=60, check=True).stdout

    ask = {"model": run.name, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    body, code = curl(json.dumps(ask)).rsplit("\n", 1)
    assert code == "200" and json.loads(body)["choices"][0]["text"] == greedy(run, "Once upon a time", 12)
    stream, code = curl(json.dumps({**ask, "stream": True})).rsplit("\n", 1)
    events = [line.removeprefix("data: ") for line in stream.splitlines() if line.startswith("data: ")]
    assert code == "200" and events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == greedy(run, "Once upon a time", 12)
    error, code = curl('{"model": ').rsplit("\n", 1)
    assert code == "400" and "not valid JSON" in json.loads(error)["error"]["message"]


def test_the_api_key_is_required_when_set(tiny_server) -> None:  # type: ignore[no-untyped-def]
    server, run = tiny_server
    code, _, answer = server.raw("/models", key="wrong")
    assert code == 401 and "API key" in answer["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()


def test_many_clients_are_answered_or_told_to_retry_and_none_is_lost(tiny_server) -> None:  # type: ignore[no-untyped-def]
    """32 clients at once against a queue of 4: each gets its answer or a 429 with Retry-After; the program's
    memory is what it was once they are gone."""
    server, run = tiny_server
    body = json.dumps({"model": run.name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}).encode()
    server.raw("/completions", body)
    before = server.rss_mb()
    results: list[tuple[int, dict, dict]] = []
    threads = [threading.Thread(target=lambda: results.append(server.raw("/completions", body))) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 32
    codes = sorted(code for code, _, _ in results)
    assert set(codes) <= {200, 429} and codes.count(200) >= 5, codes
    texts = {answer["choices"][0]["text"] for code, _, answer in results if code == 200}
    assert texts == {greedy(run, "Once upon a time", 8)}
    assert all(h.get("retry-after") == "1" for code, h, _ in results if code == 429)
    assert server.raw("/completions", body)[0] == 200
    assert server.rss_mb() < before + 30


def test_a_bundle_keeps_what_says_its_cache_can_be_reused(tiny_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A release bundle records the cache as the run does, so a server over the bundle keeps it across turns; an LFM2's
    recurrent state, a ring and a bare program do not."""
    import json

    from exporters.release.bundle import make_bundle
    from exporters.server.engine import cache_reusable

    _, run = tiny_server
    bundle, _ = make_bundle(run, tmp_path / "release")
    assert cache_reusable(run / "model.pte") is None and cache_reusable(bundle / "model.pte") is None
    manifest = json.loads((bundle / "manifest.json").read_text())
    for change, why in (({"state_bytes": 96}, "recurrent state"), ({"attention_sink": 4}, "ring cache"),
                        ({"windows": [None, 16]}, "ring cache")):
        (tmp_path / "other").mkdir(exist_ok=True)
        (tmp_path / "other" / "manifest.json").write_text(json.dumps({"kv_cache": {**manifest["kv_cache"], **change}}))
        assert why in (cache_reusable(tmp_path / "other" / "model.pte") or "")
    assert "no manifest" in (cache_reusable(tmp_path / "model.pte") or "")


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: Literal["France", "Italy", "Spain"]


@pytest.mark.slow  # the real SmolLM2 (its chat template), cut to two layers: an export other tests share
def test_chat_completions_apply_the_bundled_template(real_exported, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run = real_exported("quant=fp32").pte_path.parent
    prompt = "What is the capital of France?"
    expected = greedy(run, chat_prompt(run / "model.pte", prompt), 12)
    with serving(run, tmp_path / "serve.log") as server:
        client = server.client()
        answer = client.chat.completions.create(model=run.name, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=12, temperature=0)
        assert answer.choices[0].message.content == expected and answer.choices[0].message.role == "assistant"
        chunks = list(client.chat.completions.create(model=run.name, messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=12, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "length"
        turn = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": prompt},
                {"role": "assistant", "content": expected}, {"role": "user", "content": "And of Italy?"}]
        first = client.chat.completions.create(model=run.name, messages=turn[:2], max_tokens=4, temperature=0)
        second = client.chat.completions.create(model=run.name, messages=turn, max_tokens=4, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
        scored = client.chat.completions.create(model=run.name, messages=turn[:2], max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=2)
        content = scored.choices[0].logprobs.content
        assert len(content) == scored.usage.completion_tokens and "".join(t.token for t in content) == \
            scored.choices[0].message.content
        assert all(t.logprob == t.top_logprobs[0].logprob and len(t.top_logprobs) == 2 for t in content)
        assert all(bytes(t.bytes) == t.token.encode() for t in content)
        # Structured outputs as the client's own parse() asks them: a pydantic model as a strict JSON schema.
        parsed = client.chat.completions.parse(model=run.name, messages=turn[:2], max_tokens=48, temperature=0,
                                               response_format=City)
        assert isinstance(parsed.choices[0].message.parsed, City) and parsed.choices[0].finish_reason == "stop"
        picture = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}]
        with pytest.raises(openai.BadRequestError, match="takes text only"):
            client.chat.completions.create(model=run.name, messages=picture)
        # A client that leaves mid-stream: its generation stops at the next token, and the next client is served.
        # The program writes its remaining 103 tokens in a fraction of a second, which can end before the server
        # hears of the close (it polls every 0.1 s): a generation that finished first is tried again, up to 3 times.
        for _ in range(3):
            stream = client.chat.completions.create(model=run.name, messages=turn[:2], temperature=0, stream=True)
            next(iter(stream))
            stream.close()
            again = client.chat.completions.create(model=run.name, messages=turn[:2], max_tokens=4, temperature=0)
            assert again.choices[0].message.content == first.choices[0].message.content
            if "a client left" in (tmp_path / "serve.log").read_text():  # written before the next request ran
                break
    left = [line for line in (tmp_path / "serve.log").read_text().splitlines() if "a client left" in line]
    assert len(left) == 1, (tmp_path / "serve.log").read_text()


@pytest.mark.slow  # a swappable-adapter program other tests share
def test_an_adapter_is_a_model_and_the_base_comes_back(exported, tiny_checkpoint, tiny_adapters,  # type: ignore[no-untyped-def]
                                                       tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from tests.test_swappable_adapters import swappable

    run = swappable(exported, tiny_checkpoint, tiny_adapters).pte_path.parent
    with serving(run, tmp_path / "serve.log") as server:
        client = server.client()
        assert [m.id for m in client.models.list().data] == [run.name, "minutes", "pirate"]
        for model, adapter in ((run.name, None), ("pirate", "pirate"), (run.name, None), ("minutes", "minutes")):
            got = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=0)
            assert got.choices[0].text == greedy(run, "Once upon a time", 10, adapter), model


# A LLaVA-style chat template for the tiny LLaVA's processor (the tiny checkpoints are saved without one): a user
# turn's image parts become the processor's <image> mark.
LLAVA_TEMPLATE = ("{% for m in messages %}{{ m['role'].upper() }}: {% for c in m['content'] %}{% if c['type'] == "
                  "'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
                  "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
# A chat template that gives tools (by name: the tiny program's cache is 128 tokens) and earlier calls to the model,
# and names Hermes' <tool_call> tags (so tool_choice=auto reads calls written between them).
TOOLS_TEMPLATE = ("{% if tools %}TOOLS: {{ tools | map(attribute='function.name') | join(',') }}; call in "
                  "<tool_call></tool_call>\n{% endif %}"
                  "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}{% for call in m.get('tool_calls') "
                  "or [] %}CALL {{ call['function']['name'] }}{% endfor %}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.mark.slow  # the tiny LLaVA program tests/test_vision_language.py exports
def test_an_image_in_a_chat_is_what_generate_answers_for_it(exported, vlm_checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """An image_url data URL in a chat message, through the official client: the processor's chat template and
    the program's vision_encoder, the same greedy text as exporters.generate's chat=true with the file; URLs the
    server would have to fetch, and bytes that are no image, are a 400."""
    import base64
    import shutil

    import numpy as np
    from PIL import Image

    from tests.test_vision_language import PROGRAM

    program = exported("model=hf", f"model.checkpoint={vlm_checkpoint('llava')}", *PROGRAM).pte_path.parent
    run = tmp_path / "llava"
    shutil.copytree(program, run)
    (run / "chat_template.jinja").write_text(LLAVA_TEMPLATE)
    path = tmp_path / "picture.png"
    Image.fromarray((np.random.RandomState(0).rand(40, 50, 3) * 255).astype("uint8")).save(path)
    generator = Generator(run)
    expected = generator.generate("", SamplingConfig(8, 0.0, 1.0, 0),
                                  media=generator.with_images("Once upon a time", [str(path)], chat=True)).text
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    with serving(run, tmp_path / "serve.log") as server:
        client = server.client()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Once upon a time"}]
        answer = client.chat.completions.create(model=run.name, messages=[{"role": "user", "content": content}],
                                                max_tokens=8, temperature=0)
        assert answer.choices[0].message.content == expected
        for bad, says in (("https://example.com/cat.png", "fetches nothing"), ("data:image/png;base64,bm90IGFuIGltYWdl",
                                                                               "cannot be read as an image")):
            content[0]["image_url"]["url"] = bad
            with pytest.raises(openai.BadRequestError, match=says):
                client.chat.completions.create(model=run.name, messages=[{"role": "user", "content": content}])


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.slow  # the default tiny program, with a chat template that writes the tools
def test_tools_are_called_with_arguments_that_validate(exported, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """tools through the official client: a named function and tool_choice=required are calls whose arguments
    validate against their function's parameters, streamed or not; the template is given the tools; a next turn with
    the call and its result answers in text with tool_choice=none; tool_choice=auto answers text or valid calls."""
    import shutil

    import jsonschema

    run = tmp_path / "tools"
    shutil.copytree(exported().pte_path.parent, run)
    (run / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    with serving(run, tmp_path / "serve.log") as server:
        check_tool_calls(server.client(), run.name, jsonschema)


def check_tool_calls(client, model: str, jsonschema) -> None:  # type: ignore[no-untyped-def]

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    ask = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=80, temperature=0,
               tools=[WEATHER, CLOCK])
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}}, **ask)
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_weather"])
    cut = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         stop=['"unit"'], **ask).choices[0]  # a stop string cuts the call: text
    assert cut.finish_reason == "stop" and cut.message.tool_calls is None and cut.message.content.startswith('{"city"')
    plain = client.chat.completions.create(model=model, messages=ask["messages"], max_tokens=4, temperature=0)
    assert named.usage.prompt_tokens > plain.usage.prompt_tokens  # the template was given the tools
    streamed = list(client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                   stream=True, **ask))
    deltas = [d for c in streamed if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("get_weather", call.function.arguments)]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    # One call (parallel_tool_calls=false): the tiny random model would add calls to the list until its budget ends.
    required = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **ask).choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    for made in required.message.tool_calls:
        jsonschema.validate(json.loads(made.function.arguments), schemas[made.function.name])
    turn = [*ask["messages"], {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "12 degrees, cloudy"}]
    answer = client.chat.completions.create(**{**ask, "messages": turn}, tool_choice="none").choices[0]
    assert isinstance(answer.message.content, str) and answer.message.tool_calls is None
    # auto: text, calls between the template's tags, or both; whatever the tiny model writes, each call validates.
    chosen = client.chat.completions.create(**ask).choices[0]
    for made in chosen.message.tool_calls or []:
        jsonschema.validate(json.loads(made.function.arguments), schemas[made.function.name])
    assert chosen.finish_reason == "tool_calls" if chosen.message.tool_calls else isinstance(chosen.message.content, str)


@pytest.mark.slow  # the tiny Gemma 4 program of every modality (tests.helpers.gemma4_program_overrides)
def test_a_recording_and_an_image_in_a_chat_are_what_generate_answers_for_them(  # type: ignore[no-untyped-def]
        exported, alm_checkpoint, gemma4_assistant, tmp_path: Path) -> None:
    """An input_audio part (base64 WAV) with its text in one user message, then with an image_url beside it, through
    the official client: the program's preprocessor and encoders, the same greedy text as exporters.generate's
    audio= (image=) chat=true; a format it does not take and a recording longer than the program takes are a 400 that
    names the input."""
    import base64

    import numpy as np
    import soundfile
    from PIL import Image

    from exporters.manifest import Manifest
    from exporters.runtime.heard import audio_entry
    from exporters.validation.speech import VALIDATION_RECORDING
    from tests.helpers import gemma4_program_overrides

    run = exported(*gemma4_program_overrides(alm_checkpoint("gemma4"), gemma4_assistant)).pte_path.parent
    picture = tmp_path / "picture.png"
    Image.fromarray((np.random.RandomState(0).rand(40, 50, 3) * 255).astype("uint8")).save(picture)
    generator, entry = Generator(run), audio_entry(Manifest.read(run))
    heard = generator.with_audio("What is said?", str(VALIDATION_RECORDING), chat=True, entry=entry)
    both = generator.with_audio("What is said?", str(VALIDATION_RECORDING), chat=True, entry=entry,
                                images=[str(picture)])
    expected = [generator.generate("", SamplingConfig(8, 0.0, 1.0, 0), media=made).text for made in (heard, both)]
    long = tmp_path / "long.wav"  # 8 s: longer than one text_decoder call of this program holds (7.64 s)
    soundfile.write(long, (0.1 * np.sin(np.arange(8_000 * 8) / 10)).astype(np.float32), 8_000, subtype="PCM_16")

    def ask(path: Path, fmt: str = "wav", image: bool = False):  # type: ignore[no-untyped-def]
        audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(path.read_bytes()).decode(),
                                                        "format": fmt}}
        seen = [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()}}] if image else []
        return client.chat.completions.create(model=run.name, max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [*seen, audio, {"type": "text", "text": "What is said?"}]}])

    with serving(run, tmp_path / "serve.log") as server:
        client = server.client()
        assert ask(VALIDATION_RECORDING).choices[0].message.content == expected[0]
        assert ask(VALIDATION_RECORDING, image=True).choices[0].message.content == expected[1]
        with pytest.raises(openai.BadRequestError, match="input_audio.format='aiff'"):
            ask(VALIDATION_RECORDING, "aiff")
        with pytest.raises(openai.BadRequestError, match="input_audio is 8.00 s long"):
            ask(long)


def test_auto_tool_calls_are_constrained_from_their_opening_tag_and_read_back(tiny_checkpoint: Path) -> None:
    """tool_choice=auto with Hermes' tags (text on the tiny tokenizer; Qwen2.5's single added tokens take the other
    branch of Grammars.tagged): text and a valid call are allowed, a call with arguments outside its schema is not;
    the answer's calls are read back with the text around them. A template that names no tags this server reads is
    refused with what works."""
    import torch
    from tokenizers import Tokenizer

    from exporters.runtime.constraint import Grammars
    from exporters.server.errors import ApiError
    from exporters.server.tools import HERMES, Tool, tool_calls

    tools = [Tool(**WEATHER), Tool(**CLOCK)]
    auto = tool_calls(tools, "auto", tags=HERMES)
    with pytest.raises(ApiError, match="names none this server reads"):
        tool_calls(tools, None, tags=None)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    content, calls = auto.split("Let me look." + call)
    assert content == "Let me look." and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                          for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert auto.split("No call here.") == ("No call here.", [])
    tokenizer_file = tiny_checkpoint / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    for text, allowed in (("Let me look." + call, True), ("Just text.", True), (call.replace("Paris", "Oslo"), False)):
        constraint = Grammars(tokenizer_file, None, {2}).tagged(auto.schema, *HERMES)
        ok = True
        for token in tokenizer.encode(text, add_special_tokens=False).ids:
            if constraint.allow(torch.zeros(1, constraint.bitmask.size * 32))[0, token] != 0:
                ok = False
                break
            constraint.consume(token)
        assert ok == allowed, text


@pytest.mark.extended  # the whole SmolLM2 exported (about 4 minutes); the truncated one above runs the same code
def test_the_real_smollm2_answers_every_schema_and_calls_tools(smollm2: Path, exported, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The real SmolLM2-135M-Instruct (all 30 layers, 8da4w) through the official client: a chat answer is
    exporters.generate's, every one of benchmarks/data/json_schemas.json's 20 schemas is answered with JSON that ends by
    itself and validates, and tools are called with arguments that validate (a Hermes-style template)."""
    import shutil

    import jsonschema

    from benchmarks.grammar_engines import SCHEMAS

    result = exported("model=llama", f"model.checkpoint={smollm2}", "quant=8da4w", "export.max_seq_len=512",
                      "validate=false")
    run = tmp_path / "smollm2"
    shutil.copytree(result.pte_path.parent, run)
    prompt = "What is the capital of France?"
    expected = greedy(run, chat_prompt(run / "model.pte", prompt), 16)
    with serving(run, tmp_path / "serve.log") as server:
        client = server.client()
        answer = client.chat.completions.create(model=run.name, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=16, temperature=0)
        assert answer.choices[0].message.content == expected
        for case in json.loads(SCHEMAS.read_text()):
            got = client.chat.completions.create(
                model=run.name, messages=[{"role": "user", "content": case["prompt"] + " Answer in JSON."}],
                max_tokens=200, temperature=0, response_format=as_format(case)).choices[0]
            assert got.finish_reason == "stop", (case["name"], got.message.content)
            jsonschema.validate(json.loads(got.message.content), case["schema"])
    (run / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    with serving(run, tmp_path / "serve-tools.log") as server:
        check_tool_calls(server.client(), run.name, jsonschema)
