"""Long conversations (issue 27): a cache longer than one call (``export.max_context_len``), an int8 cache
(``export.kv_dtype=int8``), the refusals, and the program run by ExecuTorch's stock runners and ours."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from exporters.config import KvDType
from exporters.errors import UserError
from exporters.export import checked_config, run_stages
from exporters.quant.calibration import LayerByLayer
from exporters.runtime.generator import Generator, SamplingConfig
from exporters.runtime.driver import Driver
from exporters.runtime.programs import LoadedProgram
from exporters.runtime.quality import Agreement
from models.checkpoint import build_model, open_checkpoint
from models.errors import ModelError
from tests.helpers import assert_matches_transformers, compose_config, eager_model_of
from tests.runtimes import STOCK_RELEASES, stock_runner

# A prompt of more than one call (max_seq_len 16 below): the stock runner feeds it in calls of get_max_seq_len.
LONG_PROMPT = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is Madrid. "
               "The capital of Italy is")
# The logit gap under which two tokens count as tied (SmolLM2's logits here are 20-30).
NEAR_TIE = 0.25
LONG = ("quant=8da4w", "export.max_seq_len=16", "export.max_context_len=96", "export.kv_dtype=int8")


@pytest.mark.parametrize(("overrides", "says"), [
    (["export.max_seq_len=64", "export.max_context_len=32"], "export.max_context_len=32 is below export.max_seq_len=64"),
    (["backend=coreml", "export.layout=split", "export.kv_dtype=int8"], "llama::custom_quantized_sdpa"),
    (["backend=vulkan", "export.layout=split", "export.kv_dtype=int8"], "backend=vulkan"),
    (["quant=pt2e_xnnpack_dynamic", "export.kv_dtype=int8"], "quant.pt2e"),
    (["backend=coreml", "export.layout=split", "export.max_seq_len=16", "export.max_context_len=64",
      "export.prefill_chunk=32"], "export.prefill_chunk=32 must be between 1 and 16"),
])
def test_a_cache_that_does_not_fit_is_refused_before_any_work(overrides: list[str], says: str) -> None:
    with pytest.raises(UserError, match=says.replace("(", r"\(").replace(".", r"\.")):
        checked_config(compose_config(*overrides))


def test_int8_cache_on_a_model_the_kernel_cannot_compute_is_refused_at_load(family_checkpoint, tmp_path: Path) -> None:
    """Gemma 2 soft-caps its attention logits: ATen attention, so no quantized-cache kernel; nothing is written."""
    cfg = compose_config("model=hf", f"model.checkpoint={family_checkpoint('gemma2')}", "export.kv_dtype=int8")
    with pytest.raises(ModelError, match="export.kv_dtype=int8.*soft-capping"):
        run_stages(cfg, tmp_path)
    assert not list(tmp_path.glob("*.pte"))


def test_int8_cache_is_a_quarter_of_the_bytes_and_close_to_fp32(tiny_checkpoint: Path) -> None:
    """Per token and head: head_dim int8 codes, an fp32 scale and an int8 zero point (against 4 x head_dim bytes);
    attention over it stays close to the fp32 cache's, and swapping to fp32 for a reference restores the int8 cache."""
    ckpt = open_checkpoint(tiny_checkpoint)
    model = build_model(ckpt, 64, attention="custom_ops", kv_dtype="int8")
    d = model.args.head_dim
    tokens = torch.randint(0, model.args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        quantized = model(tokens, torch.tensor([0]), full_logits=True)[0]
        cache = model.model.layers[0].self_attn.kv_cache
        with model.kv_dtype_as(KvDType.fp32):
            fp32_bytes = model.kv_bytes_per_token()
            reference = model(tokens, torch.tensor([0]), full_logits=True)[0]
        assert model.model.layers[0].self_attn.kv_cache is cache and cache.k_cache.dtype == torch.int8
    assert model.kv_bytes_per_token() / fp32_bytes == pytest.approx((d + 5) / (4 * d))
    agreement = Agreement.of(reference, quantized)
    assert float(agreement.kl.mean()) < 1e-3 and float(agreement.top1.double().mean()) > 0.9


@pytest.fixture(scope="module")
def long_context(real_exported):  # type: ignore[no-untyped-def]
    return real_exported(*LONG)


def test_the_cache_outlives_one_call_and_the_program_says_so(long_context) -> None:  # type: ignore[no-untyped-def]
    m = long_context.manifest
    assert m.constant_methods["get_max_seq_len"] == 16 and m.constant_methods["get_max_context_len"] == 96
    assert m.methods["prefill"].tokens == [1, 16] and m.methods["forward"].tokens == [1, 16]
    assert m.kv_cache is not None
    kv = m.kv_cache
    assert (kv.positions, kv.tokens_per_call, kv.dtype) == (96, 16, "int8")
    # SmolLM2: 3 kv heads of 64 per layer, keys and values: (64 + 4 + 1) bytes each, against 256 in fp32.
    assert kv.bytes_per_token == 2 * 2 * 3 * (64 + 4 + 1) and kv.bytes == 96 * kv.bytes_per_token
    v = m.validation
    assert v is not None and v.passed and v.eager_kv_dtype == "fp32"
    cfg = checked_config(compose_config(*LONG))
    assert v.tolerance["max_kl"] == pytest.approx(cfg.quant.max_kl + cfg.validation.int8_kv.max_kl)  # quant's plus int8_kv's


def test_generation_runs_past_one_call_to_the_end_of_the_cache(long_context) -> None:  # type: ignore[no-untyped-def]
    model = eager_model_of(long_context)
    gen = Generator(long_context.pte_path)
    ids = gen.encode(LONG_PROMPT)
    assert 16 < len(ids) < 96
    out = gen.generate("", SamplingConfig(max_new_tokens=200), prompt_ids=ids)
    assert out.stop_reason == "context_full" and len(ids) + len(out.new_ids) == 96
    with torch.no_grad():  # the eager model with the same int8 cache, fed the program's tokens one by one
        logits, gaps = model(torch.tensor([ids]), torch.tensor([0])), []
        for pos, token in zip(range(len(ids), 96), out.new_ids):
            gaps.append(float(logits.max() - logits.flatten()[token]))  # 0 where the eager model chooses it too
            logits = model(torch.tensor([[token]]), torch.tensor([pos]))
    # Every token the program chose to the end of the cache is the eager model's greedy choice, or within a near tie of
    # it: the 4-bit kernels round by the CPU's instructions (AVX-512 without VNNI flips a tie of 0.03 in 24.7 here).
    assert max(gaps) < NEAR_TIE and sum(g == 0 for g in gaps) / len(gaps) > 0.9, gaps


@pytest.mark.parametrize("release", STOCK_RELEASES)
def test_stock_runner_feeds_a_long_prompt_in_calls_into_the_int8_cache(long_context, release: str) -> None:
    """The runner prefills the prompt in calls of get_max_seq_len tokens and generates into the int8 cache: the
    text our generator writes (greedy) on the same program."""
    pte = long_context.pte_path
    tokenizer = Tokenizer.from_file(str(pte.parent / "tokenizer.json"))
    ids = tokenizer.encode(LONG_PROMPT).ids
    assert len(ids) > 16
    result = stock_runner(release, pte, LONG_PROMPT, 12)
    ours = Generator(pte).generate("", SamplingConfig(max_new_tokens=12), prompt_ids=ids)
    assert result["text"] == tokenizer.decode(ours.new_ids), (result["text"], result["log"][-2000:])


# --- ring buffers: sliding-window layers keep their window, a sink keeps the conversation going ----------------


@pytest.mark.parametrize("attention", ["aten", "custom_ops"])
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_windowed_layers_in_a_ring_match_transformers_past_the_window(family_checkpoint, family: str,
                                                                      attention: str) -> None:
    """Calls of at most 4 tokens: each windowed layer keeps window + 3 slots, and 24 tokens wrap them several times."""
    from tests.family_cases import FAMILY_CASES
    from tests.test_families import transformers_model

    ckpt = family_checkpoint(family)
    ours = build_model(open_checkpoint(ckpt), 48, attention=attention, call_tokens=4)
    window = FAMILY_CASES[family]["sliding_window"]
    rings = [g for g in ours.args.layer_geometry if g.ring]
    assert rings and all(g.slots == window + 3 and g.window == window for g in rings)
    assert ours.args.attention == attention  # windows no longer send a model to ATen attention
    tokens = torch.randint(0, ours.args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    reference = transformers_model(ckpt)
    assert_matches_transformers(reference, ours, tokens, prefill_len=4)
    with torch.no_grad():  # the whole window at once (eager: baseline, validation) goes in calls of 4 by itself
        ours.reset_cache()
        whole = ours(tokens, torch.tensor([0]), full_logits=True)
        torch.testing.assert_close(whole, reference(tokens).logits, atol=1e-4, rtol=0)
        # calibration's layer-by-layer run cuts windows into calls too
        run = LayerByLayer(ours, [tokens])
        states = run.embedded
        for i in range(ours.args.num_hidden_layers):
            states = run.layer(i, states)
        torch.testing.assert_close(ours.final_logits(states[0]), whole, atol=1e-5, rtol=0)


def linear_reference(model, geometry_slots: int):  # type: ignore[no-untyped-def]
    """The same weights with one long linear cache and the sink's mask (the sink and the last context - sink
    positions): what the ring must compute, without any wrapping."""
    import dataclasses

    from models.decoder import CausalLM, DecoderArgs
    from models.kv_cache import CacheGeometry

    a = model.args
    geometry = CacheGeometry(geometry_slots, a.attention_sink, a.max_context_len - a.attention_sink, ring=False)

    class LinearWithSinkMask(DecoderArgs):
        @property
        def layer_geometry(self):  # type: ignore[no-untyped-def]
            return (geometry,) * self.num_hidden_layers

    args = LinearWithSinkMask(**{**{f.name: getattr(a, f.name) for f in dataclasses.fields(DecoderArgs)},
                                 "max_context_len": geometry_slots, "attention": "aten", "kv_dtype": "fp32",
                                 "attention_sink": 0, "call_tokens": None})
    reference = CausalLM(args).eval()
    reference.load_state_dict(model.state_dict())
    return reference


@pytest.mark.parametrize("attention", ["aten", "custom_ops"])
def test_a_sink_ring_computes_what_a_long_cache_with_the_sink_mask_computes(tiny_checkpoint: Path,
                                                                             attention: str) -> None:
    """150 positions through a 32-position cache (sink 4, calls of up to 8): prompt, single steps, then calls that
    cross the ring's wrap; every logit as the linear reference's."""
    model = build_model(open_checkpoint(tiny_checkpoint), 32, attention=attention, attention_sink=4, call_tokens=8)
    assert {(g.slots, g.sink, g.window, g.ring) for g in model.args.layer_geometry} == {(39, 4, 28, True)}
    reference = linear_reference(model, 160)
    tokens = torch.randint(0, model.args.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    pos, ours, expected = 0, [], []
    with torch.no_grad():
        while pos < 150:
            n = 8 if pos == 0 or pos >= 60 else 1
            n = min(n, 150 - pos)
            for model_, out in ((model, ours), (reference, expected)):
                out.append(model_(tokens[:, pos:pos + n], torch.tensor([pos]), full_logits=True)[0])
            pos += n
    torch.testing.assert_close(torch.cat(ours), torch.cat(expected), atol=2e-5, rtol=0)


@pytest.mark.parametrize(("overrides", "says"), [
    (["export.max_seq_len=16", "export.max_context_len=32", "export.attention_sink=16"],
     "export.attention_sink=16 does not fit"),
    (["export.attention_sink=-1"], "export.attention_sink=-1 does not fit"),
    (["backend=coreml", "export.layout=split", "export.attention_sink=4"], "static-shape backends"),
])
def test_a_sink_that_does_not_fit_is_refused_before_any_work(overrides: list[str], says: str) -> None:
    with pytest.raises(UserError, match=says.replace("(", r"\(").replace(".", r"\.")):
        checked_config(compose_config(*overrides))


# The int8 ring tests/test_speculative.py reads (its verify method and int8 slots change nothing the tests below
# check: the eager model keeps the same int8 cache): one export for both files.
SINK = ("quant=fp32", "export.kv_dtype=int8", "export.max_seq_len=8", "export.max_context_len=32",
        "export.attention_sink=4", "export.methods=[prefill,decode,forward,verify]")


def greedy_through(driver, eos: set[int], turns: list[list[int]], per_turn: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """What the stock runner does over several generate() calls: each prompt prefilled where the last turn
    stopped, then greedy tokens; the last token of a turn is not fed (the runner's position skips it)."""
    pos, out = 0, []
    for prompt in turns:
        logits = driver.prefill(torch.tensor([prompt]), start=pos)
        pos += len(prompt)
        new = [int(logits.argmax())]
        while len(new) < per_turn and new[-1] not in eos:
            logits = driver.decode_one_token(new[-1], pos)
            pos += 1
            new.append(int(logits.argmax()))
        out.append(new)
    return out


def test_a_sink_program_generates_four_caches_long_as_the_eager_model(exported) -> None:  # type: ignore[no-untyped-def]
    result = exported(*SINK)
    m = result.manifest
    from exporters.components.resolve import plan_export
    from models.kv_cache import CacheGeometry

    state = plan_export(compose_config(*SINK)).main.build.state  # 32 positions, calls of 8, a sink of 4
    # The sink, the last 28 positions, and room for one call's other tokens (written before they attend).
    slots = CacheGeometry.of(state.positions, None, state.attention_sink, state.call_tokens).slots
    assert slots == state.attention_sink + (state.positions - state.attention_sink) + state.call_tokens - 1
    assert m.kv_cache is not None and m.kv_cache.attention_sink == 4 and m.kv_cache.slots == [slots] * m.constant_methods["get_n_layers"]
    assert m.constant_methods["attention_sink_size"] == 4 and m.constant_methods["attention_sink_window_size"] == 28
    assert all(o.result == "correct" for o in m.layout.stock_runners.values())
    gen = Generator(result.pte_path)
    gen.eos_ids = set()
    ids = gen.encode("the cat")
    out = gen.generate("", SamplingConfig(max_new_tokens=4 * 32), prompt_ids=ids)
    assert out.stop_reason == "max_new_tokens" and len(out.new_ids) == 128
    model = eager_model_of(result)
    with torch.no_grad():
        logits, expected = model(torch.tensor([ids]), torch.tensor([0])), []
        for pos in range(len(ids), len(ids) + 128):
            expected.append(int(logits.argmax()))
            logits = model(torch.tensor([[expected[-1]]]), torch.tensor([pos]))
    assert out.new_ids == expected
    assert len(set(expected[64:])) > 2, "a degenerate text past the cache would hide a broken ring"


@pytest.mark.parametrize("release", STOCK_RELEASES)
def test_stock_runner_carries_a_sink_program_over_four_caches(exported, release: str) -> None:
    """Each generate() call of the stock runner stops at get_max_context_len tokens and the next goes on from its
    position: four turns run the conversation to about four caches, each turn the text our driver writes."""
    result = exported(*SINK)
    pte = result.pte_path
    prompt = "the cat"
    runner = stock_runner(release, pte, prompt, 32, turns=4)
    tokenizer = Tokenizer.from_file(str(pte.parent / "tokenizer.json"))
    program = LoadedProgram(pte)
    eos_ids = program.constant("get_eos_ids")
    eos = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    prompt_ids = tokenizer.encode(prompt).ids  # as the runner encodes it (tokenizer.json's own special tokens)
    ours = greedy_through(Driver.of(program), eos, [prompt_ids] * 4, 32)
    assert sum(len(t) for t in ours) + 4 * len(prompt_ids) > 3 * 32
    assert runner["turns"] == [tokenizer.decode(t) for t in ours], runner["log"][-3000:]


def test_stock_runner_stops_with_an_error_at_the_end_of_a_cache_without_a_sink(long_context) -> None:  # type: ignore[no-untyped-def]
    """max_seq_len < max_context_len without a sink (16 and 96 here): the manifest says the runner fails at the end
    of the cache, and it does (after correct text)."""
    import subprocess
    import sys

    from tests.runtimes import STOCK_RUNNER_SCRIPT

    result = long_context
    verdicts = result.manifest.layout.stock_runners
    assert {o.result for o in verdicts.values()} == {"fails"} and "attention_sink" in verdicts["1.5.1"].fix
    pte = result.pte_path
    proc = subprocess.run([sys.executable, str(STOCK_RUNNER_SCRIPT), str(pte), str(pte.parent / "tokenizer.json"),
                           "the cat", "100"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Generation failed" in proc.stderr


# Mistral's windowed layers are all of its layers; Gemma 3's program runs the same rings beside full-attention layers,
# so Mistral's runs with `pytest -m extended`, kept out of the full run for its time.
@pytest.mark.parametrize("family", [pytest.param("mistral", marks=pytest.mark.extended), "gemma3"])
def test_a_program_with_window_rings_matches_transformers_past_the_window(exported, family_checkpoint,
                                                                          family: str) -> None:
    """Calls of at most 4 tokens: the windowed layers' caches are rings of window + 3 slots on llama::custom_sdpa;
    the program, driven as generation drives it, gives transformers' logits and greedy tokens past the window.
    (One forward method for the prompt's calls and each step, as the families' parity tests.)"""
    from tests.family_cases import FAMILY_CASES
    from tests.test_families import PARITY_METHODS, prompt_ids, transformers_model

    ckpt = family_checkpoint(family)
    result = exported(f"model={family}", f"model.checkpoint={ckpt}", "export.max_seq_len=4",
                      "export.max_context_len=48", f"export.methods={PARITY_METHODS}")
    window = FAMILY_CASES[family]["sliding_window"]
    kv = result.manifest.kv_cache
    assert kv is not None and result.manifest.model.attention == "custom_ops"
    assert {s for s, w in zip(kv.slots, kv.windows) if w is not None} == {window + 3}
    reference = transformers_model(ckpt)
    driver = Driver.of(LoadedProgram(result.pte_path))
    tokens = prompt_ids(ckpt)
    logits = driver.prefill(tokens)[0]  # in calls of 4
    with torch.no_grad():
        for _ in range(3 * window):
            expected = reference(tokens).logits[0, -1]
            assert (logits - expected).abs().max().item() <= 1e-4, f"position {tokens.shape[1]}"
            next_token = logits.argmax().view(1, 1)
            logits = driver.decode_one_token(next_token, tokens.shape[1])[0]
            tokens = torch.cat([tokens, next_token], dim=1)
    assert tokens.shape[1] > 3 * window


@pytest.mark.parametrize("backend,stored", [("xnnpack", "fp32"), ("openvino", "fp16")])
def test_the_cache_record_names_the_dtype_it_stores(tmp_path: Path, backend: str, stored: str) -> None:
    """quant.dtype=fp16: ExecuTorch's attention kernels keep an fp32 cache (xnnpack); ATen attention (OpenVINO)
    keeps it in fp16, and the manifest's kv_cache and the console say so (2 bytes per element, not 4)."""
    from exporters.components.resolve import plan_export
    from exporters.program.cache import kv_cache_entry
    from exporters.quant.apply import quantize_model

    plan = plan_export(compose_config("quant=fp16", f"backend={backend}", "export.layout=split",
                                      "export.methods=[prefill,decode]"))
    build = plan.main.build
    model = build.build(build.checkpoint(tmp_path))
    quantize_model(model, plan.main.quant.config)
    entry = kv_cache_entry(model, plan.lengths.call_tokens)
    a = model.args
    elements = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim  # keys and values, per token
    assert entry.dtype == stored and entry.bytes_per_token == elements * (4 if stored == "fp32" else 2)
    assert f"positions of {stored}" in entry.describe()
