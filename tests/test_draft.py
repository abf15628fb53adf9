"""A draft model in the program (issue 41): its methods beside the target's in one program, its own KV cache, its own
quantization and validation, and speculative decoding with it exactly as plain greedy decoding; pairs that cannot
work refused before any weight is read."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from exporters.config import compose, quant_option, to_typed
from exporters.errors import UserError
from exporters.export import checked_config, export
from exporters.program.draft import DRAFT_METHODS, check_pair
from exporters.runtime.driver import Driver
from exporters.runtime.generator import Generator, SamplingConfig
from exporters.runtime.programs import LoadedProgram
from models.checkpoint import open_checkpoint
from models.tiny import write_tiny_checkpoint
from tests.conftest import shared_folder
from tests.helpers import compose_config

# The draft: the tiny model's tokenizer, one layer of half the width, trained on the same text with another seed.
DRAFT_ARCH = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}
PROMPTS = ("The cache holds the keys and values of every token.", "Quantization trades")


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_folder(tmp_path_factory, "tiny_draft", lambda f: write_tiny_checkpoint(f, arch=DRAFT_ARCH, seed=5))


@pytest.fixture(scope="session")
def draft_program(exported, tiny_draft: Path):  # type: ignore[no-untyped-def]
    """The tiny target in fp32 with the tiny draft in 8da8w."""
    return exported(f"draft.checkpoint={tiny_draft}", "draft.quant=8da8w")


def test_the_draft_is_a_component_with_its_own_methods_quantization_and_validation(draft_program) -> None:  # type: ignore[no-untyped-def]
    m = draft_program.manifest
    assert set(m.components) == {"decoder", "draft"}
    draft = m.components["draft"]
    assert set(draft.methods) == DRAFT_METHODS and draft.kind == "draft" and draft.family == "llama"
    assert draft.parameters is not None and draft.parameters < m.components["decoder"].parameters
    assert draft.quantization is not None and draft.quantization.linear is not None
    assert draft.quantization.linear.scheme == "8da8w" and m.quantization.linear is None  # the target stays fp32
    assert draft.validation is not None and draft.validation.passed and draft.validation.checked == "runtime"
    assert draft.validation.methods["prompt"] == "draft_prefill"
    assert draft.validation.tolerance["max_kl"] == quant_option("8da8w").max_kl  # the draft's quant's tolerance
    # The target got verify without asking, and the runners find everything from the program alone.
    assert "verify" in m.methods and m.constant_methods["get_draft_tokens"] == 4
    assert not set(m.layout.methods) & DRAFT_METHODS  # the plain methods are the target's
    assert all(o.result == "correct" for o in m.layout.stock_runners.values())
    check = m.validation.speculative
    assert check is not None and check.proposer == "draft" and check.identical and check.acceptance > 0, check


def test_speculative_greedy_with_the_draft_is_plain_greedy(draft_program) -> None:  # type: ignore[no-untyped-def]
    generator = Generator(draft_program.pte_path)
    greedy = SamplingConfig(max_new_tokens=48)
    for prompt in PROMPTS:
        plain = generator.generate(prompt, greedy, speculative="none")
        fast = generator.generate(prompt, greedy, speculative="draft")
        auto = generator.generate(prompt, greedy, speculative="auto")  # the draft, since the program has one
        assert fast.new_ids == plain.new_ids == auto.new_ids
        assert fast.speculation is not None and fast.speculation.accepted > 0, fast.speculation
        assert auto.speculation is not None and auto.speculation.proposed == fast.speculation.proposed


def test_the_speculative_benchmark_measures_the_draft_too(draft_program) -> None:  # type: ignore[no-untyped-def]
    from benchmarks.speculative import TASKS, measure

    found = measure(draft_program.pte_path.parent, tokens=12, repeats=1)
    assert set(found) == set(TASKS)
    for modes in found.values():
        assert set(modes) == {"none", "lookup", "draft"} and modes["draft"]["identical"]
        assert modes["draft"]["tokens_per_call"] >= 1 and modes["none"]["speedup"] == 1.0


def test_the_draft_writes_its_own_cache_not_the_targets(draft_program) -> None:  # type: ignore[no-untyped-def]
    """ExecuTorch shares a mutable buffer between methods that name it alike; the draft's are named under ``draft.``:
    running the draft between two target calls leaves the target's next logits bit for bit as they were."""
    program = LoadedProgram(draft_program.pte_path)
    target, draft = Driver.of(program), Driver.of(program, "draft")
    prompt = torch.tensor([[1, 40, 41, 42, 43, 44]])
    target.prefill(prompt)
    alone = target.decode_one_token(45, prompt.shape[1])
    target.prefill(prompt)
    draft.prefill(torch.tensor([[1, 90, 91, 92, 93, 94, 95, 96]]))  # other tokens at the same positions and beyond
    draft.decode_one_token(97, 8)
    assert torch.equal(target.decode_one_token(45, prompt.shape[1]), alone)


def test_speculative_draft_needs_a_draft(exported) -> None:  # type: ignore[no-untyped-def]
    generator = Generator(exported("quant=8da4w", "export.methods=[prefill,decode,forward,verify]").pte_path)  # test_speculative's
    with pytest.raises(UserError, match=r"speculative=draft needs a draft model.*draft.checkpoint"):
        generator.speculation("draft")
    assert generator.speculation("auto") is None  # verify without a draft: auto decodes one token per call


def test_a_draft_with_another_tokenizer_is_refused_before_any_weight_is_read(tiny_checkpoint: Path,
                                                                             tmp_path: Path) -> None:
    other = write_tiny_checkpoint(tmp_path / "sp", arch=DRAFT_ARCH, tokenizer="sentencepiece")
    with pytest.raises(UserError, match=r"another tokenizer than the target .* pairs differ.*own family"):
        export(compose_config("model=llama", f"model.checkpoint={tiny_checkpoint}", f"draft.checkpoint={other}"),
               tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.pte"))


def test_a_draft_as_large_as_its_target_is_warned_about(tiny_checkpoint: Path, tiny_draft: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    small, large = open_checkpoint(tiny_draft), open_checkpoint(tiny_checkpoint)
    with caplog.at_level(logging.WARNING, logger="exporters"):
        check_pair(small, small, 100, 90)
        assert not caplog.records
        check_pair(small, large, 90, 100)
    assert "costs more per proposal than verify saves" in caplog.text


# Each case as a user writes it; {draft} stands for the tiny draft's folder.
@pytest.mark.parametrize(("overrides", "match"), [
    (["draft.quant=8da8w"], "without draft.checkpoint: there is no draft"),
    (["draft.checkpoint=/nowhere/draft"], "does not exist"),
    (["draft.checkpoint={draft}", "draft.quant=pt2e_xnnpack_dynamic"], "a PT2E quantizer converts one graph of the target"),
    (["draft.checkpoint={draft}", "draft.quant=8da3w"], r"not a preset of conf/quant: use one of .*8da4w"),
    (["draft.checkpoint={draft}", "quant=pt2e_xnnpack_dynamic", "export.layout=split", "export.methods=[prefill,decode]"],
     "draft.checkpoint adds verify and quant.pt2e"),
    (["draft.checkpoint={draft}", "draft.tokens=127"], "draft.tokens must be between 1 and 126"),
])
def test_draft_settings_that_cannot_work_are_refused_with_the_fix(tiny_draft: Path, overrides: list[str],
                                                                  match: str) -> None:
    with pytest.raises(UserError, match=match):
        checked_config(compose_config(*(o.format(draft=tiny_draft) for o in overrides)))


def test_draft_with_adapters_is_refused(tiny_checkpoint: Path, tiny_draft: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "chat"  # a real (untrained) PEFT adapter of the tiny model
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_checkpoint),
                   LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(folder)
    with pytest.raises(UserError, match="do not hold adapters yet"):
        checked_config(compose_config(f"draft.checkpoint={tiny_draft}", f"+model.adapters={{chat: {folder}}}"))


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).parent.parent / "conf" / "quant").glob("*.yaml")))
def test_a_quant_option_read_alone_is_what_hydra_composes(name: str) -> None:
    """draft.quant=<name> reads conf/quant/<name>.yaml with its defaults list, as quant=<name> composes it."""
    assert quant_option(name) == to_typed(compose(f"quant={name}")).quant
