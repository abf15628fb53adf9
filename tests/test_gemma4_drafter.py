"""Gemma 4's assistant (the "MTP drafter", models.gemma4_drafter) against transformers' own, on tiny checkpoints:
the same logits and proposals inside and past the sliding window, with and without the centroid head; proposals
from any state speculation leaves the target in equal those from a clean prompt; the pair refused when the assistant
was made for another target.

transformers 5.23 cannot build its assistant without ``models.gemma4_drafter.assistant_buildable`` (see there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exporters.runtime.driver import Driver, MethodRoles
from exporters.runtime.sampling import SamplingConfig
from exporters.runtime.speculative import AssistantProposer, Speculation, Stops, continue_text
from models.checkpoint import build_model, open_checkpoint
from models.decoder import CausalLM
from models.errors import ModelError
from models.gemma4_drafter import Gemma4Drafter, assistant_buildable, load_drafter
from models.tiny import write_tiny_gemma4_assistant

CONTEXT = 64
WINDOW = 6  # tests/family_cases.py's Gemma 4: prompts of 5 and 12 tokens are inside and past it


def pair(family_checkpoint, folder: Path, ordered: bool = False) -> tuple[CausalLM, Gemma4Drafter]:  # type: ignore[no-untyped-def]
    target = build_model(open_checkpoint(family_checkpoint("gemma4")), CONTEXT, keeps_final_hidden=True)
    write_tiny_gemma4_assistant(folder, family_checkpoint("gemma4"), ordered=ordered)
    return target, load_drafter(folder, target)


@pytest.mark.parametrize("ordered", [False, True], ids=["lm_head", "centroids"])
def test_the_assistant_proposes_what_transformers_assistant_proposes(family_checkpoint, tmp_path: Path,
                                                                     ordered: bool) -> None:
    """transformers' candidate loop (``Gemma4AssistantCandidateGenerator``) after a prompt: the target's scaled
    embedding of the last token beside its last hidden state, then the assistant's own projected state, at one
    position. Ours reads the same from the target's caches and kept final hidden states."""
    from transformers import AutoModelForCausalLM, Gemma4AssistantForCausalLM

    target, drafter = pair(family_checkpoint, tmp_path, ordered)
    reference = AutoModelForCausalLM.from_pretrained(family_checkpoint("gemma4"), attn_implementation="eager").eval()
    with assistant_buildable():
        assistant = Gemma4AssistantForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    for length in (5, 2 * WINDOW):
        ids = torch.randint(3, 397, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            out = reference(input_ids=ids, output_hidden_states=True, return_shared_kv_states=True)
            target.reset_cache()
            target(ids, torch.tensor([0]))
            torch.testing.assert_close(target.final_hidden[:length], out.hidden_states[-1][0], atol=1e-5, rtol=0)
            first = token = out.logits[0, -1].argmax().view(1, 1)
            theirs, hidden, ours = [], out.hidden_states[-1][:, -1:], None
            for _ in range(3):
                step = assistant(inputs_embeds=torch.cat([reference.get_input_embeddings()(token), hidden], dim=-1),
                                 position_ids=torch.tensor([[length]]), shared_kv_states=out.shared_kv_states,
                                 attention_mask=torch.ones(1, length + 1, dtype=torch.long))
                logits, ours = drafter.logits_of(target, token, torch.tensor([length]), ours)
                torch.testing.assert_close(ours, step.last_hidden_state, atol=1e-5, rtol=0)
                if not ordered:  # the centroid head scores a few tokens; transformers fills the rest with a floor
                    torch.testing.assert_close(logits[0], step.logits[0, -1], atol=1e-5, rtol=0)
                token, hidden = step.logits.argmax(-1), step.last_hidden_state
                theirs.append(int(token))
            assert drafter.propose(target, first, torch.tensor([length]), 3)[0].tolist() == theirs


def test_the_centroid_head_reads_a_quantized_heads_rows_as_their_dequantized_values() -> None:
    """8da4w's head is int4 codes by groups of 32 with a scale and zero point each: the rows the centroid head scores
    are gathered from those, never the whole matrix dequantized."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    from models.gemma4_drafter import rows_of

    head = torch.nn.Linear(64, 300, bias=False)
    quantize_(head, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    rows = torch.tensor([5, 0, 299, 17])
    assert torch.equal(rows_of(head.weight, rows), head.weight.dequantize().index_select(0, rows))


class EagerPair:
    """The target's and the assistant's methods as a program runs them (``Driver``'s ``run``), eagerly."""

    def __init__(self, target: CausalLM, drafter: Gemma4Drafter, k: int) -> None:
        self.target, self.drafter, self.k = target, drafter, k

    @torch.no_grad()
    def run(self, method: str, tokens: torch.Tensor, input_pos: torch.Tensor) -> list[torch.Tensor]:
        if method == "draft_propose":
            return [self.drafter.propose(self.target, tokens, input_pos, self.k)]
        return [self.target(tokens, input_pos, full_logits=method == "verify")]


def test_speculation_with_the_assistant_is_plain_greedy_and_proposes_as_from_a_clean_prompt(family_checkpoint,
                                                                                           tmp_path: Path) -> None:
    """Greedy speculative decoding through verify is token for token plain greedy decoding; and every proposal the
    assistant made from the state speculation left (caches and final hidden states holding rejected proposals past
    the text) is the proposal it makes after a clean prompt of the same text: it reads nothing it should not."""
    target, drafter = pair(family_checkpoint, tmp_path)
    k = 3
    driver = Driver(EagerPair(target, drafter, k), MethodRoles("prefill", "decode", CONTEXT, False, "verify", k + 1, 1))
    prompt = torch.randint(3, 397, (1, 9), generator=torch.Generator().manual_seed(1)).tolist()[0]
    cfg, stops = SamplingConfig(temperature=0.0, max_new_tokens=24), Stops(set(), CONTEXT)
    target.reset_cache()
    plain, _, _ = continue_text(driver, prompt, driver.prefill(torch.tensor([prompt])), cfg, stops)
    proposer = AssistantProposer(driver.program, "draft_propose")
    seen: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose
    proposer.propose = lambda ids, n: seen.append((list(ids), propose(ids, n))) or seen[-1][1]  # type: ignore[method-assign]
    target.reset_cache()
    fast, _, stats = continue_text(driver, prompt, driver.prefill(torch.tensor([prompt])), cfg, stops,
                                   Speculation(proposer))
    assert fast == plain and stats is not None and stats.steps >= 4
    for ids, proposals in seen:
        target.reset_cache()
        with torch.no_grad():
            target(torch.tensor([ids[:-1]]), torch.tensor([0]))
            clean = drafter.propose(target, torch.tensor([ids[-1:]]), torch.tensor([len(ids) - 1]), k)
        assert proposals == clean[0, :len(proposals)].tolist(), len(ids)
    assert any(len(ids) > len(prompt) + WINDOW for ids, _ in seen)  # some proposals past the sliding window


def test_an_assistant_made_for_another_target_is_refused(family_checkpoint, tmp_path: Path) -> None:
    target, _ = pair(family_checkpoint, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["sliding_window"] = WINDOW + 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="reads the target's last sliding_attention layer's cache.*made for another"):
        load_drafter(tmp_path, target)
    plain = build_model(open_checkpoint(family_checkpoint("gemma4")), CONTEXT)
    with pytest.raises(ModelError, match="keeps no final hidden states"):
        load_drafter(tmp_path, plain)


@pytest.fixture(scope="session")
def assistant_folder(family_checkpoint, gemma4_assistant) -> Path:  # type: ignore[no-untyped-def]
    """The assistant of tests/family_cases.py's Gemma 4 (6 layers, text alone)."""
    return gemma4_assistant(family_checkpoint("gemma4"))


@pytest.mark.parametrize("program", ["images", pytest.param("8da4w", marks=pytest.mark.extended)])
def test_a_program_holds_the_assistant_and_speculation_with_it_is_plain_greedy(  # type: ignore[no-untyped-def]
        exported, family_checkpoint, alm_checkpoint, gemma4_assistant, assistant_folder: Path, program: str,
        tmp_path: Path) -> None:
    """draft.checkpoint=<assistant>: the decoder gets verify and keeps its final hidden states; draft_propose reads
    them and the caches in the runtime, proposing what the eager assistant proposes over the eager decoder's state;
    exporters.generate speculates with it (speculative=draft, and auto) and writes plain greedy decoding's tokens; a
    release bundle's README says how an app calls it.
    ``images``: fp32 beside Gemma 4's image and audio paths (the program of every modality, one export for four
    tests: tests.helpers.gemma4_program_overrides), proposals exactly the eager assistant's, and speculation after an
    image prompt plain greedy decoding's too.
    ``8da4w`` (the assistant's quant too: its centroid head reads rows of the quantized head), text alone: extended,
    for the full run's time."""
    from exporters.program.audio import AUDIO_METHOD
    from exporters.program.vision import VISION_METHOD
    from exporters.runtime.generator import Generator
    from tests.helpers import VLM_ASSISTANT_TOKENS, gemma4_program_overrides

    if program == "images":
        overrides = gemma4_program_overrides(alm_checkpoint("gemma4"), gemma4_assistant)
    else:
        overrides = ["model=gemma4", f"model.checkpoint={family_checkpoint('gemma4')}", "export.methods=[decode]",
                     "export.layout=split", "export.max_seq_len=32", "quant=8da4w",
                     f"draft.checkpoint={assistant_folder}", f"draft.tokens={VLM_ASSISTANT_TOKENS}"]
    result = exported(*overrides)
    m = result.manifest
    entry = m.components["draft"]
    assert entry.kind == "assistant" and entry.methods == ["draft_propose"] and entry.family == "gemma4"
    check = entry.assistant
    assert check is not None and check.passed and check.tokens == VLM_ASSISTANT_TOKENS, check
    assert entry.quantization is not None and (entry.quantization.linear is None) == (program == "images")
    if program == "images":  # unquantized: every proposal is the eager assistant's
        assert check.all_agreement == 1.0, check
    image_path = {"token_embedding", "text_decoder", VISION_METHOD, AUDIO_METHOD} if program == "images" else set()
    assert set(m.methods) == {"decode", "verify", "draft_propose", *image_path}
    assert m.methods["draft_propose"].tokens == [1, 1] and not m.methods["draft_propose"].dynamic_tokens
    assert m.methods["draft_propose"].outputs[0].shape == [1, VLM_ASSISTANT_TOKENS]
    assert m.methods["verify"].tokens[1] == VLM_ASSISTANT_TOKENS + 1
    speculative = m.validation.speculative
    assert speculative is not None and speculative.identical and speculative.proposer == "draft", speculative
    generator = Generator(result.pte_path)
    greedy = SamplingConfig(max_new_tokens=20)
    plain = generator.generate("Once upon a time", greedy, speculative="none")
    for mode in ("draft", "auto"):
        fast = generator.generate("Once upon a time", greedy, speculative=mode)
        assert fast.new_ids == plain.new_ids and fast.speculation is not None and fast.speculation.steps > 0
    if program == "images":  # after an image prompt, the assistant reads the caches the image's embeddings filled
        from PIL import Image

        Image.new("RGB", (48, 48), (200, 40, 90)).save(tmp_path / "picture.png")
        made = generator.with_images("<|image|> Describe it.", [str(tmp_path / "picture.png")])
        plain = generator.generate("", greedy, speculative="none", media=made)
        fast = generator.generate("", greedy, speculative="draft", media=made)
        assert fast.new_ids == plain.new_ids and fast.speculation is not None and fast.speculation.steps > 0
        from benchmarks.proposal_cost import measure  # what a round of proposals costs against the model's calls

        cost = measure(str(result.pte_path), prompt=8, repeats=2)
        assert cost["proposer"] == "assistant" and cost["draft_tokens"] == VLM_ASSISTANT_TOKENS
        assert min(cost["step_ms"], cost["verify_ms"], cost["propose_ms"]) > 0
        # 0 when a round costs no more than one step (timing on a tiny model under the suite's load can say so)
        assert cost["break_even_acceptance"] is None or 0 <= cost["break_even_acceptance"] <= 1
    from exporters.release.bundle import make_bundle

    bundle, _ = make_bundle(result.pte_path.parent, tmp_path / "release")
    assert "`draft_propose` takes the last token (int64[1, 1])" in (bundle / "README.md").read_text()


@pytest.mark.parametrize(("overrides", "says"), [
    (["draft.vocab=64"], "draft.vocab=64 with Gemma 4's assistant"),
    (["export.attention_sink=4", "export.max_context_len=64"], "export.attention_sink=4 with Gemma 4's assistant"),
    (["draft.quant=8da4w_calibrated"], "calibrated scheme"),
    (["export.max_seq_len=4", "draft.tokens=3"], "draft.tokens=3 with Gemma 4's assistant.*at most 1 .*Lower draft.tokens to 1"),
])
def test_what_the_assistant_cannot_do_is_refused_before_any_work(assistant_folder: Path, overrides: list[str],
                                                                  says: str) -> None:
    from exporters.errors import UserError
    from exporters.export import checked_config
    from tests.helpers import compose_config

    with pytest.raises(UserError, match=says):
        checked_config(compose_config(f"draft.checkpoint={assistant_folder}", *overrides))


def test_the_assistant_of_another_family_is_refused_before_any_weight_is_read(assistant_folder: Path,
                                                                              tmp_path: Path) -> None:
    from exporters.errors import UserError
    from exporters.export import run_stages
    from tests.helpers import compose_config

    with pytest.raises(UserError, match="is Gemma 4's assistant, and the model is llama"):
        run_stages(compose_config(f"draft.checkpoint={assistant_folder}"), tmp_path)
    assert not list(tmp_path.glob("*.pte"))
