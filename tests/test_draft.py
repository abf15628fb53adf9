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
from models.errors import ModelError
from models.tiny import BOS_ID, CORPUS, EOS_ID, UNK_ID, write_tiny_checkpoint
from models.vocabulary import frequent_tokens
from tests.conftest import shared_folder
from tests.helpers import compose_config

# The draft: the tiny model's tokenizer, one layer of half the width, trained on the same text with another seed.
DRAFT_ARCH = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}
PROMPTS = ("The cache holds the keys and values of every token.", "Quantization trades")


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_folder(tmp_path_factory, "tiny_draft", lambda f: write_tiny_checkpoint(f, arch=DRAFT_ARCH, seed=5))


# FR-Spec: the draft scores 256 of the 384 tokens, ranked by their count in the tiny model's training text.
DRAFT_VOCAB = 256


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_folder(tmp_path_factory, "corpus", lambda f: (f / "corpus.txt").write_text(CORPUS)) / "corpus.txt"


@pytest.fixture(scope="session")
def draft_program(exported, tiny_draft: Path, corpus_file: Path):  # type: ignore[no-untyped-def]
    """The tiny target in fp32 with the tiny draft in 8da8w, proposing among DRAFT_VOCAB tokens (the unrestricted
    head is the same code without the row selection, models.decoder.CausalLM.score_only)."""
    return exported(f"draft.checkpoint={tiny_draft}", "draft.quant=8da8w", f"draft.vocab={DRAFT_VOCAB}",
                    f"draft.vocab_text={corpus_file}")


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
    # FR-Spec: the draft's logits are its DRAFT_VOCAB tokens, which the program lists; its perplexity is over the text's
    # tokens among them, and the manifest says how many those are.
    vocabulary = draft.vocabulary
    assert vocabulary is not None and vocabulary.tokens == DRAFT_VOCAB and vocabulary.ranked_by.endswith("corpus.txt")
    assert vocabulary.coverage is not None and 0.9 < vocabulary.coverage <= 1
    assert draft.validation.scored_tokens == round(vocabulary.coverage * m.validation.scored_tokens)
    assert m.constant_methods["get_draft_vocab"] == f"int64 tensor [{DRAFT_VOCAB}]"
    assert m.methods["draft_decode_one_token"].outputs[0].shape == [1, DRAFT_VOCAB]


def test_a_draft_proposes_only_the_tokens_its_head_scores(draft_program, tiny_draft: Path, corpus_file: Path,  # type: ignore[no-untyped-def]
                                                         tmp_path: Path) -> None:
    """The program's list is the ranking's, every proposal is one of its tokens, and the bundle says so."""
    from exporters.release.bundle import make_bundle

    generator = Generator(draft_program.pte_path)
    vocab = generator.program.constant("get_draft_vocab")
    checkpoint = open_checkpoint(tiny_draft)
    assert torch.equal(vocab, frequent_tokens(checkpoint, DRAFT_VOCAB, 384, corpus_file))
    proposer = generator.speculation("draft")
    ids = generator.encode(PROMPTS[0])
    proposed = proposer.propose(ids, 4) + proposer.propose(ids + [5, 6], 4)  # type: ignore[union-attr]
    assert set(proposed) <= set(vocab.tolist())
    bundle, _ = make_bundle(draft_program.pte_path.parent, tmp_path / "release")
    readme = (bundle / "README.md").read_text()
    assert f"`get_draft_vocab` (int64[{DRAFT_VOCAB}])" in readme and "int64[1, T] with T from 2 to 5" in readme


def test_the_vocabulary_ranking_keeps_special_tokens_and_counts_the_text(tiny_draft: Path, tmp_path: Path) -> None:
    checkpoint = open_checkpoint(tiny_draft)
    by_order = frequent_tokens(checkpoint, 100, 384)
    assert len(by_order) == 100 and torch.equal(by_order, by_order.sort().values)
    assert {UNK_ID, BOS_ID, EOS_ID} <= set(by_order.tolist())  # special tokens always
    assert by_order.tolist() == list(range(100))  # the tokenizer's order: its first ids (the specials among them)
    from models.tokenizer import find_tokenizer, load_tokenizer

    text = tmp_path / "text.txt"
    text.write_text("quietly quietly quietly")
    counted = frequent_tokens(checkpoint, 100, 384, text).tolist()
    late = load_tokenizer(find_tokenizer(tiny_draft)).encode("quietly")  # type: ignore[arg-type]
    assert set(late) <= set(counted) and not set(late) <= set(by_order.tolist())
    with pytest.raises(ModelError, match=r"draft.vocab=3: .* between 4 and 383"):
        frequent_tokens(checkpoint, 3, 384)


def test_a_restricted_head_computes_the_same_logits_for_its_tokens(tiny_draft: Path) -> None:
    from models.checkpoint import build_model

    checkpoint = open_checkpoint(tiny_draft)
    full, restricted = build_model(checkpoint, 64), build_model(checkpoint, 64)
    ids = frequent_tokens(checkpoint, 200, 384)
    restricted.score_only(ids)
    tokens = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        assert torch.equal(restricted(tokens, torch.tensor([0]), full_logits=True),
                           full(tokens, torch.tensor([0]), full_logits=True)[..., ids])
    assert restricted.lm_head.weight.shape == (200, checkpoint.hf_config.hidden_size)
    assert restricted.lm_head.weight is not restricted.model.embed_tokens.weight  # no longer tied


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


def test_speculative_draft_needs_a_draft_and_the_refusal_offers_fixes_that_work(exported) -> None:  # type: ignore[no-untyped-def]
    """Refused before any weight is loaded, with fixes that work: a draft (test_draft_program_...), or, where the
    program has verify, lookup; never verify alone, which enables lookup only."""
    generator = Generator(exported("quant=8da4w", "export.methods=[prefill,decode,forward,verify]").pte_path,  # test_speculative's
                          load=False)
    with pytest.raises(UserError, match=r"speculative=draft needs a draft model.*draft.checkpoint") as refused:
        generator.check_speculation("draft")
    assert "export.methods" not in str(refused.value) and "speculative=lookup" in str(refused.value)
    assert not {"prefill", "decode_one_token", "forward", "verify"} & generator.program.loaded
    assert generator.speculation("auto") is None  # verify without a draft: auto decodes one token per call
    assert generator.speculation("lookup") is not None  # the fix it offers
    plain = Generator(exported().pte_path, load=False)  # no verify: lookup is not offered
    with pytest.raises(UserError, match=r"speculative=draft needs a draft model") as refused:
        plain.check_speculation("draft")
    assert "lookup" not in str(refused.value) and "export.methods" not in str(refused.value)


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
    (["draft.vocab=4096"], r"draft.vocab=4096 without draft.checkpoint"),
    (["draft.checkpoint={draft}", "draft.vocab_text=/nowhere.txt"], r"without draft.vocab: .*draft.vocab=<how many>"),
    (["draft.checkpoint={draft}", "draft.vocab=100", "draft.vocab_text=/nowhere.txt"],
     r"no such file\. .*or leave it unset to rank tokens by the tokenizer's order"),
    (["draft.checkpoint={draft}", "draft.vocab=100", "draft.vocab_text={draft}/model.safetensors"],
     "cannot be read as UTF-8 text"),
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
