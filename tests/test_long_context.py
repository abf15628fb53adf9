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
from exporters.program.layouts import STOCK_RUNNERS
from exporters.runtime.generator import Generator, SamplingConfig
from exporters.runtime.quality import Agreement
from models.checkpoint import build_model, open_checkpoint
from models.errors import ModelError
from tests.helpers import compose_config, eager_model_of
from tests.runtimes import stock_runner

# A prompt of more than one call (max_seq_len 16 below): the stock runner feeds it in calls of get_max_seq_len.
LONG_PROMPT = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is Madrid. "
               "The capital of Italy is")
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
    assert v.tolerance["max_kl"] > 1e-3  # quant's plus validation.int8_kv's


def test_generation_runs_past_one_call_to_the_end_of_the_cache(long_context) -> None:  # type: ignore[no-untyped-def]
    model = eager_model_of(long_context)
    gen = Generator(long_context.pte_path)
    ids = gen.encode(LONG_PROMPT)
    assert 16 < len(ids) < 96
    out = gen.generate("", SamplingConfig(max_new_tokens=200), prompt_ids=ids)
    assert out.stop_reason == "context_full" and len(ids) + len(out.new_ids) == 96
    with torch.no_grad():  # the eager model with the same int8 cache, greedy, token by token
        logits, expected = model(torch.tensor([ids]), torch.tensor([0])), []
        for pos in range(len(ids), 96):
            expected.append(int(logits.argmax()))
            logits = model(torch.tensor([[expected[-1]]]), torch.tensor([pos]))
    agree = sum(a == b for a, b in zip(out.new_ids, expected)) / len(expected)
    assert out.new_ids[:8] == expected[:8] and agree > 0.9, (out.new_ids, expected)


@pytest.mark.parametrize("release", [r.release for r in STOCK_RUNNERS])
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
