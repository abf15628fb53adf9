"""Running what was exported (our generate, ExecuTorch's stock runner) and shipping it (bundles)."""

from __future__ import annotations

import json
from importlib import metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exporters.runtime.speed import measure_speeds
from exporters.release.bundle import make_bundle, verify_bundle
from exporters.runtime.driver import Driver
from exporters.errors import UserError
from exporters.runtime.generator import Generator, SamplingConfig, TextStream, chat_prompt
from exporters.runtime.programs import LoadedProgram
from tests.helpers import REPO_ROOT, compose_config

PROMPT = "Once upon a time"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def default_export(exported):  # type: ignore[no-untyped-def]
    """The default command's program: prefill, decode and forward, xnnpack fp32."""
    return exported()


def stock_runner_text(pte: Path, prompt: str, max_new_tokens: int) -> str:
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    pieces: list[str] = []
    runner = TextLLMRunner(str(pte), str(pte.parent / "tokenizer.json"))
    runner.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, echo=False, num_bos=1),
                    token_callback=pieces.append)
    return "".join(pieces)


def test_stock_runner_ours_and_eager_agree_on_greedy_text(default_export) -> None:
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    pte = default_export.pte_path
    ours = Generator(pte).generate(PROMPT, SamplingConfig(max_new_tokens=NEW_TOKENS))
    assert ours.stop_reason == "max_new_tokens" and len(ours.new_ids) == NEW_TOKENS

    eager = LlamaForCausalLM.from_pretrained(str(pte.parent / "checkpoint")).eval()
    out = eager.generate(torch.tensor([ours.prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    eager_ids = out[0, len(ours.prompt_ids):].tolist()
    assert ours.new_ids == eager_ids
    tokenizer = Tokenizer.from_file(str(pte.parent / "tokenizer.json"))
    assert ours.text == tokenizer.decode(eager_ids)
    assert stock_runner_text(pte, PROMPT, NEW_TOKENS) == ours.text


def test_forward_costs_graph_bytes_not_weight_bytes(exported, default_export) -> None:
    two = exported("export.methods=[prefill,decode]", "export.layout=split").manifest.program.storage
    three = default_export.manifest.program.storage
    alone = exported("export.methods=[forward]").manifest.program.storage
    assert two["named_data_bytes"] == three["named_data_bytes"] == alone["named_data_bytes"]
    # Non-delegated constants agree up to a few bytes of per-graph scalars (e.g. decode's static positions).
    assert max(s["constant_buffer_bytes"] for s in (two, three, alone)) - min(
        s["constant_buffer_bytes"] for s in (two, three, alone)) < 1024
    assert three["total_bytes"] - two["total_bytes"] < 0.15 * two["named_data_bytes"]


def test_generate_falls_back_to_forward_only_programs(exported, default_export) -> None:
    forward_only = exported("export.methods=[forward]")
    greedy = SamplingConfig(max_new_tokens=NEW_TOKENS)
    expected = Generator(default_export.pte_path).generate(PROMPT, greedy)
    assert Generator(forward_only.pte_path).generate(PROMPT, greedy).new_ids == expected.new_ids


def test_programs_compared_side_by_side_each_run_their_own_methods(exported, default_export) -> None:
    """bench_export's comparison: two programs timed in alternating rounds, each through its own methods."""
    forward_only = exported("export.methods=[forward]")
    drivers = {"ours": Driver.of(LoadedProgram(default_export.pte_path)),
               "forward only": Driver.of(LoadedProgram(forward_only.pte_path))}
    speeds = measure_speeds(drivers, prompt_tokens=8, steps=4, repeats=2, vocab_size=256)
    assert (speeds["ours"].prompt_method, speeds["ours"].step_method) == ("prefill", "decode_one_token")
    assert (speeds["forward only"].prompt_method, speeds["forward only"].step_method) == ("forward", "forward")
    for speed in speeds.values():
        assert (speed.prompt_tokens, speed.steps, speed.repeats) == (8, 4, 2)
        assert speed.prefill_tokens_per_s > 0 and speed.decode_tokens_per_s > 0


def test_sampling_is_seeded_and_stops_at_eos(default_export) -> None:
    gen = Generator(default_export.pte_path)
    cfg = SamplingConfig(max_new_tokens=40, temperature=1.2, top_p=0.95, seed=7)
    a, b = gen.generate(PROMPT, cfg), gen.generate(PROMPT, cfg)
    assert a.new_ids == b.new_ids, "same seed, same text"
    others = {tuple(gen.generate(PROMPT, SamplingConfig(40, 1.2, 0.95, seed)).new_ids) for seed in range(4)}
    assert len(others) > 1, "different seeds explore different continuations"
    gen.eos_ids = {a.new_ids[3]}  # pretend the 4th sampled token is the eos token
    assert gen.generate(PROMPT, cfg).stop_reason == "eos"


def test_too_long_prompt_is_a_clear_error(default_export) -> None:
    with pytest.raises(UserError, match="cache holds 128"):
        Generator(default_export.pte_path).generate("word " * 300, SamplingConfig())


def test_streaming_never_splits_a_character(tiny_checkpoint: Path) -> None:
    """Byte-level BPE spreads é, ö, ☃ over several tokens; each streamed piece is whole text."""
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_checkpoint / "tokenizer.json")
    text = "héllo wörld ☃ über naïve"
    ids = tok.encode(text)
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(ids) > len(text.split()), "the test needs multi-token characters"


def test_chat_template_is_applied_when_asked(tmp_path: Path, default_export) -> None:
    run = tmp_path / "run"
    shutil.copytree(default_export.pte_path.parent, run, ignore=shutil.ignore_patterns("checkpoint"))
    with pytest.raises(UserError, match="chat_template"):
        chat_prompt(run / "model.pte", "hi")
    config = json.loads((run / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    (run / "tokenizer_config.json").write_text(json.dumps(config))
    assert chat_prompt(run / "model.pte", "hi") == "<user>hi<assistant>"
    # Current checkpoints keep it in chat_template.jinja, which wins.
    (run / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert chat_prompt(run / "model.pte", "hi") == "[hi]"


def test_generate_cli_streams_and_reports_speed(default_export) -> None:
    proc = subprocess.run([sys.executable, "-m", "exporters.generate", str(default_export.pte_path.parent),
                           f"prompt={PROMPT}", "max_new_tokens=12"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    expected = Generator(default_export.pte_path).generate(PROMPT, SamplingConfig(max_new_tokens=12)).text
    assert proc.stdout.startswith(PROMPT + expected)
    assert "tok/s" in proc.stderr and "stopped: max_new_tokens" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "exporters.generate", str(default_export.pte_path), "promt=x"],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    assert bad.returncode == 2 and "promt" in bad.stderr and "Traceback" not in bad.stderr


def test_same_config_exports_byte_identical_programs(tmp_path: Path, default_export) -> None:
    from exporters.export import export

    again = export(compose_config(), tmp_path)
    assert again.manifest.program.sha256 == default_export.manifest.program.sha256


def test_bundle_holds_everything_and_verifies(tmp_path: Path, default_export) -> None:
    folder, archive = make_bundle(default_export.pte_path.parent, tmp_path / "a")
    assert {p.name for p in folder.iterdir()} == {
        "model.pte", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "manifest.json", "README.md"}
    m = json.loads((folder / "manifest.json").read_text())
    assert m["files"]["model.pte"]["sha256"] == default_export.manifest.program.sha256
    assert set(m["methods"]) == {"prefill", "decode_one_token", "forward"} and m["constant_methods"]["get_max_seq_len"] == 128
    assert m["layout"]["name"] == "stock" and {o["result"] for o in m["layout"]["stock_runners"].values()} == {"correct"}
    assert m["validation"]["passed"] and m["versions"]["executorch"] == metadata.version("executorch")
    readme = (folder / "README.md").read_text()
    assert 'load_method("prefill")' in readme and 'load_method("decode_one_token")' in readme
    assert "share_memory_arenas=*/true" in readme and "| 1.5.1 | correct |" in readme
    calls = default_export.manifest.kv_cache.tokens_per_call  # the cache less one: a prompt leaves room to generate
    assert calls == default_export.manifest.methods["prefill"].tokens[1] and f"at most\n{calls} per call." in readme
    assert verify_bundle(folder) == [] and verify_bundle(archive) == []
    greedy = SamplingConfig(max_new_tokens=NEW_TOKENS)  # the bundle runs as the run folder does
    assert Generator(folder).generate(PROMPT, greedy).new_ids == Generator(default_export.pte_path).generate(
        PROMPT, greedy).new_ids
    _, archive2 = make_bundle(default_export.pte_path.parent, tmp_path / "b")
    assert archive.read_bytes() == archive2.read_bytes(), "packaging is deterministic"


def test_verify_fails_loudly_on_changed_or_missing_files(tmp_path: Path, default_export) -> None:
    folder, _ = make_bundle(default_export.pte_path.parent, tmp_path)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "generation_config.json").unlink()
    problems = verify_bundle(folder)
    assert any(p.startswith("changed: tokenizer.json") for p in problems)
    assert "missing: generation_config.json" in problems
    proc = subprocess.run([sys.executable, "-m", "exporters.package", "--verify", str(folder)],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 1 and "FAIL changed: tokenizer.json" in proc.stderr


def test_rejected_exports_are_not_packaged(tmp_path: Path, default_export) -> None:
    run = tmp_path / "run"
    shutil.copytree(default_export.pte_path.parent, run, ignore=shutil.ignore_patterns("checkpoint"))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["status"] = "failed validation"
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="only validated exports are packaged"):
        make_bundle(run)


def test_a_renamed_program_is_found_by_generate_and_package(exported, default_export, tmp_path: Path) -> None:
    """export.output_name: generate and package read the program's name from the manifest."""
    renamed = exported("export.output_name=smol.pte", "export.methods=[decode]", "export.layout=split")
    run_dir = renamed.pte_path.parent
    assert renamed.pte_path.name == "smol.pte" and not (run_dir / "model.pte").exists()
    greedy = SamplingConfig(max_new_tokens=NEW_TOKENS)
    assert Generator(run_dir).generate(PROMPT, greedy).new_ids == Generator(default_export.pte_path).generate(
        PROMPT, greedy).new_ids
    folder, archive = make_bundle(run_dir, tmp_path)
    assert (folder / "smol.pte").is_file() and 'load_program("smol.pte")' in (folder / "README.md").read_text()
    assert verify_bundle(archive) == []
