"""Speculative decoding over the verify method (issue 41): exact output, rollback by position in every cache kind,
validation that rejects a wrong verify, and the accept/reject rule's distribution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exporters.errors import UserError, ValidationFailed
from exporters.export import checked_config
from exporters.runtime.generator import Generator, SamplingConfig
from exporters.runtime.speculative import DraftLength, accept, lookup_proposals
from tests.helpers import compose_config

VERIFY = "export.methods=[prefill,decode,forward,verify]"
# A prompt that repeats itself, so lookup proposes and the tiny model (trained on it) accepts.
PROMPT = "The cache holds the keys and values of every token. The cache holds the keys and values"


def test_lookup_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    assert lookup_proposals([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]  # the latest "1 2 3"
    assert lookup_proposals([4, 5, 6, 4, 5], 4) == [6, 4, 5]  # the longest suffix that occurred before
    assert lookup_proposals([1, 2, 3], 4) == []  # nothing repeats
    assert lookup_proposals([8, 8], 2) == [8]


def test_greedy_acceptance_keeps_proposals_while_the_target_agrees() -> None:
    logits = torch.full((4, 6), -10.0)
    for row, token in enumerate([2, 3, 5, 1]):
        logits[row, token] = 10.0
    gen = torch.Generator()
    kept = accept(logits, [2, 3, 4], lambda r: torch.softmax(r, -1), gen, greedy=True)
    assert kept.kept == [2, 3] and kept.next_token == 5  # the target's own token replaces the first miss
    every = accept(logits, [2, 3, 5], lambda r: torch.softmax(r, -1), gen, greedy=True)
    assert every.kept == [2, 3, 5] and every.next_token == 1  # all kept: the bonus token after them


def test_sampled_acceptance_gives_exactly_the_targets_distribution() -> None:
    """A proposal kept with probability p(d), else a token drawn from p without d: the first token is p-distributed
    whatever is proposed (checked empirically against p over 40k draws)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(p).repeat(2, 1)
    gen = torch.Generator().manual_seed(0)
    for proposal in (0, 3):
        counts = torch.zeros(4)
        for _ in range(40_000):
            a = accept(logits, [proposal], lambda r: torch.softmax(r, -1), gen, greedy=False)
            counts[a.kept[0] if a.kept else a.next_token] += 1
        assert torch.allclose(counts / counts.sum(), p, atol=0.01), (proposal, counts / counts.sum())


def test_proposals_per_call_adapt_as_transformers_heuristic_schedule_does() -> None:
    length = DraftLength(most=6)
    assert length.current == 6  # start at the most the program's verify takes
    for proposed, kept, then in [(6, 2, 5), (5, 0, 4), (4, 4, 6), (6, 6, 6), (6, 0, 5)]:
        length.update(proposed, kept)
        assert length.current == then
    for _ in range(10):
        length.update(length.current, 0)
    assert length.current == 1  # never below one proposal
    fixed = DraftLength(most=6, tokens=2)
    fixed.update(2, 2)
    assert fixed.current == 2
    with pytest.raises(UserError, match=r"draft_tokens=7: the program's verify checks 1 to 6 proposals"):
        DraftLength(most=6, tokens=7)


def test_draft_tokens_must_fit_one_call() -> None:
    # a cache of 8 positions: calls of at most 7 tokens, so at most 6 proposals
    with pytest.raises(UserError, match=r"draft.tokens=8: verify takes .* at most 7 tokens .* between 1 and 6"):
        checked_config(compose_config(VERIFY, "export.max_seq_len=8", "draft.tokens=8"))
    with pytest.raises(UserError, match="draft.tokens=0"):
        checked_config(compose_config("draft.tokens=0"))
    with pytest.raises(UserError, match="verify needs every position's"):
        checked_config(compose_config("export.methods=[prefill,decode,verify]", "export.layout=split",
                                      "quant=pt2e_xnnpack_dynamic"))
    checked_config(compose_config("export.max_seq_len=4"))  # without verify, draft.tokens does not matter
    # ... unless it is given: then it would be ignored, so it is refused, naming the two ways to give it a meaning
    with pytest.raises(UserError, match=r"draft.tokens=3 without draft.checkpoint or verify in export.methods.*"
                                        r"draft.checkpoint=.*export.methods=\[prefill,decode,forward,verify\]"):
        checked_config(compose_config("draft.tokens=3"))
    checked_config(compose_config(VERIFY, "draft.tokens=3"))  # with verify it sets how many proposals verify checks


# The linear cache on the 8da4w program other tests read; an int8 ring (an attention sink) on fp32 weights (faster to
# lower: what is tested is the cache's rollback, which the weights' format does not touch): a slot quantized per
# position and a ring's slots, in one program.
@pytest.mark.parametrize("cache", [["quant=8da4w"], ["quant=fp32", "export.kv_dtype=int8", "export.max_seq_len=8",
                                                     "export.max_context_len=32", "export.attention_sink=4"]],
                         ids=["linear", "int8-sink"])
def test_speculative_greedy_is_plain_greedy_in_every_cache(exported, cache: list[str]) -> None:  # type: ignore[no-untyped-def]
    """Rejected proposals are written into the cache and rolled back by position alone: the next tokens are exactly
    plain greedy decoding's, in a linear, an int8 and a ring (sink) cache, in the runtime."""
    result = exported(VERIFY, *cache)
    m = result.manifest
    assert m.constant_methods["get_draft_tokens"] == 4 and m.methods["verify"].tokens == [2, 5]
    assert m.constant_methods["get_verify_min_tokens"] == 2  # 1 to 4 proposals per call
    assert m.methods["verify"].outputs[0].shape == [1, "num_tokens", m.constant_methods["get_vocab_size"]]
    assert all(o.result == "correct" for o in m.layout.stock_runners.values())  # the plain methods serve them
    check = m.validation.speculative
    assert check is not None and check.identical and check.verify_kl <= m.validation.tolerance["max_kl"], check
    generator = Generator(result.pte_path)
    greedy = SamplingConfig(max_new_tokens=60 if any("attention_sink" in o for o in cache) else 40)
    plain = generator.generate(PROMPT, greedy, speculative="none")
    fast = generator.generate(PROMPT, greedy, speculative="lookup")
    assert fast.new_ids == plain.new_ids and plain.speculation is None
    assert fast.speculation is not None and fast.speculation.accepted > 0, fast.speculation
    assert fast.speculation.tokens_per_call > 1
    # Every number of proposals per call verify takes gives the same tokens (a shorter call rolls back the same way).
    for k in (1, 2, 4):
        fixed = generator.generate(PROMPT, greedy, speculative="lookup", draft_tokens=k)
        assert fixed.new_ids == plain.new_ids, k
        assert fixed.speculation is not None and fixed.speculation.proposed <= k * fixed.speculation.steps
    with pytest.raises(UserError, match=r"draft_tokens=5: the program's verify checks 1 to 4 proposals per call"):
        generator.generate(PROMPT, greedy, speculative="lookup", draft_tokens=5)


def test_the_speculative_benchmark_measures_each_task(exported) -> None:  # type: ignore[no-untyped-def]
    """benchmarks.speculative on the same program: both modes' speed, acceptance and identity per task."""
    from benchmarks.speculative import TASKS, measure

    found = measure(exported("quant=8da4w", VERIFY).pte_path.parent, tokens=12, repeats=1)
    assert set(found) == set(TASKS)
    for modes in found.values():
        assert set(modes) == {"none", "lookup"}  # no draft in this program
        assert all(r["identical"] and r["tok_s"] > 0 and r["tokens_per_call"] >= 1 for r in modes.values())


def test_a_program_without_verify_says_how_to_get_one(exported) -> None:  # type: ignore[no-untyped-def]
    generator = Generator(exported().pte_path)
    with pytest.raises(UserError, match=r"speculative=lookup needs the program's verify method.*export.methods"):
        generator.generate(PROMPT, SamplingConfig(max_new_tokens=4), speculative="lookup")
    assert generator.generate(PROMPT, SamplingConfig(max_new_tokens=4), speculative="auto").speculation is None


@pytest.mark.slow
def test_a_wrong_verify_is_rejected(tmp_path: Path) -> None:
    """Negative control: verify's logits shifted by one token after capture (the other methods untouched) must fail
    validation, and the program is kept only as model.rejected.pte."""
    from exporters.export import build_stages
    from exporters.components.resolve import plan_export
    from exporters.stages.pipeline import ExportContext, Stage, run_pipeline

    class ShiftVerify(Stage):
        name = "tamper"  # type: ignore[assignment]
        after = ("capture",)

        def run(self, captured, ctx):  # type: ignore[no-untyped-def]
            graph = captured.programs["verify"].graph_module.graph
            output = next(n for n in graph.nodes if n.op == "output")
            logits = output.args[0][-1]
            with graph.inserting_before(output):
                rolled = graph.call_function(torch.ops.aten.roll.default, (logits, [1], [-1]))
            output.args = ((*output.args[0][:-1], rolled),)
            graph.lint()
            captured.programs["verify"].graph_module.recompile()
            return captured

    plan = plan_export(compose_config("export.methods=[decode,verify]", "export.layout=split",
                                      "validation.warn_ppl_increase=null"))
    stages = build_stages(plan)
    stages.insert([s.name for s in stages].index("capture") + 1, ShiftVerify(plan))
    with pytest.raises(ValidationFailed, match="verify differs from the eager model"):
        run_pipeline(stages, ExportContext(plan=plan, output_dir=tmp_path))
    assert (tmp_path / "model.rejected.pte").exists() and not (tmp_path / "model.pte").exists()
