"""ExecuTorch's stock runner of every release we claim, on real weights: the text it prints is the text
transformers (fp32) or the eager quantized model (8da4w) writes, and the manifest's prediction of each
runner's outcome (``exporters.program.layouts``) is what the runner really does.

The installed runtime is one release; the others run in cached virtual environments (``tests/runtimes.py``),
built from the package registry on first use (about a minute when pip's cache has the wheels).
"""

from __future__ import annotations

import re

import pytest
import torch
from tokenizers import Tokenizer

from exporters.runtime.generator import Generator, SamplingConfig, chat_prompt
from tests.helpers import eager_model_of
from tests.runtimes import STOCK_RELEASES, stock_runner

pytestmark = pytest.mark.slow  # every test here exports, sweeps or builds


PROMPT = "The capital of France is"
NEW_TOKENS = 12


def stat(result: dict, name: str) -> int:
    return int(re.search(rf"{name}=(\d+)", result["stats"][-1]).group(1))


def greedy_ids(logits_of, prompt_ids: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """n greedy tokens from a function (tokens [1, T], position) -> next-token logits."""
    tokens, new = torch.tensor([prompt_ids]), []
    logits = logits_of(tokens, 0)
    for _ in range(n):
        new.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
        logits = logits_of(torch.tensor([[new[-1]]]), len(prompt_ids) + len(new) - 1)
    return new


def assert_runner_writes(release: str, pte, expected_ids: list[int], data=None) -> None:  # type: ignore[no-untyped-def]
    result = stock_runner(release, pte, PROMPT, NEW_TOKENS, data=data)
    n = printed_tokens(result)
    assert n == NEW_TOKENS and stat(result, "num_prompt_tokens") == len(runner_prompt_ids(pte)), result
    expected = Tokenizer.from_file(str(pte.parent / "tokenizer.json")).decode(expected_ids[:n])
    assert result["text"] == expected, f"ExecuTorch {release}: {result['text']!r} != {expected!r}\n{result['log'][-2000:]}"


def printed_tokens(result: dict) -> int:
    """Tokens in the runner's text: its statistics leave out the first, which prefill produced."""
    return stat(result, "num_generated_tokens") + 1


def runner_prompt_ids(pte) -> list[int]:  # type: ignore[no-untyped-def]
    """The prompt as the stock runner tokenizes it: tokenizer.json's own special tokens (SmolLM2's add none)."""
    return Tokenizer.from_file(str(pte.parent / "tokenizer.json")).encode(PROMPT).ids


@pytest.fixture(scope="module")
def prompt_ids(real_exported) -> list[int]:  # type: ignore[no-untyped-def]
    return runner_prompt_ids(real_exported("quant=fp32").pte_path)


@pytest.mark.parametrize("release", STOCK_RELEASES)
def test_stock_layout_fp32_writes_transformers_text(real_exported, smollm2_truncated, prompt_ids, release: str) -> None:
    from transformers import AutoModelForCausalLM

    result = real_exported("quant=fp32")
    assert set(result.manifest.methods) == {"prefill", "decode_one_token", "forward"}
    # SmolLM2-Instruct's chat template is a chat_template.jinja: copied beside the program and applied.
    assert "chat_template.jinja" in result.manifest.tokenizer_files
    assert chat_prompt(result.pte_path, "Hi").startswith("<|im_start|>")
    assert result.manifest.layout.stock_runners[release].result == "correct"
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_truncated), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt_ids):].tolist()
    assert len(set(expected)) > 2, "a degenerate greedy text would hide a cache that does not carry"
    assert_runner_writes(release, result.pte_path, expected)


@pytest.mark.parametrize("release", STOCK_RELEASES)
def test_stock_runner_loads_the_program_with_its_data_file(real_exported, prompt_ids, release: str) -> None:
    """8da4w with export.weights=external: each release's runner, given model.pte and model.ptd, writes the same text
    as the eager quantized model; the program holds no weights. (The program tests/test_quant_backends.py checks
    against the eager model in the runtime; a program with its weights inside runs the same kernels, and the stock
    runners load one in the fp32 test above.)"""
    result = real_exported("quant=8da4w", "export.weights=external")
    data = result.pte_path.with_suffix(".ptd")
    assert result.manifest.data is not None and result.manifest.data.file == data.name and data.is_file()
    assert result.manifest.program.size_bytes < data.stat().st_size / 20
    model = eager_model_of(result)
    with torch.no_grad():
        expected = greedy_ids(lambda t, pos: model(t, torch.tensor([pos])), prompt_ids, NEW_TOKENS)
    assert_runner_writes(release, result.pte_path, expected, data=data)


@pytest.mark.parametrize("release", STOCK_RELEASES)
def test_split_layout_does_what_the_manifest_says(real_exported, smollm2_truncated, prompt_ids, release: str) -> None:
    """The prefill/decode names: right in 1.4.1 (it runs forward only), wrong text in 1.5.1 (forward, then
    decode with a cache of its own), and the manifest says so before anyone runs it."""
    split = real_exported("quant=fp32", "export.layout=split")
    outcome = split.manifest.layout.stock_runners[release]
    expected = Generator(real_exported("quant=fp32").pte_path).generate(
        PROMPT, SamplingConfig(max_new_tokens=NEW_TOKENS), prompt_ids=prompt_ids).new_ids
    result = stock_runner(release, split.pte_path, PROMPT, NEW_TOKENS)
    expected_text = Tokenizer.from_file(str(split.pte_path.parent / "tokenizer.json")).decode(
        expected[:printed_tokens(result)])
    assert outcome.result == ("correct" if result["text"] == expected_text else "wrong text"), result
    assert outcome.result == {"1.4.1": "correct", "1.5.1": "wrong text"}[release]
    assert f"Using method: {outcome.prompt_method}" in result["log"]
