"""The benchmark tools (``python -m benchmarks.<tool>``) and the sweep presets (``conf/experiment/``) still run.

One smoke test per tool on the ``tiny`` preset, each through the tool's own command line as a user types it:
seconds to a couple of minutes each, so they are marked ``slow``. They check that a tool runs end to end and
writes what it promises, not its numbers (a tiny random model's speed and memory mean nothing).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.presets import PRESETS
from exporters.config import compose, to_typed
from exporters.sweeps.summary import read_rows
from tests.conftest import shared_folder
from tests.helpers import REPO_ROOT

# Small exports: a short context, few tokens to validate and to time.
SMALL = ["--max-seq-len", "64"]


def run_tool(tool: str, *args: object, env: dict[str, str] | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """``python -m benchmarks.<tool> <args>`` from the top of the checkout."""
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{tool}", *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    if check:
        assert proc.returncode == 0, f"benchmarks.{tool} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def run_sweep(sweep_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "exporters.llm", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


# The benchmark tools run end to end (an export or a sweep each, 40-200 s): kept out of the full run for its time
# and run by `pytest -m extended`; the ones that only compose, read or tabulate stay in it.
BENCHMARK_RUN = pytest.mark.extended


# ---- presets ----------------------------------------------------------------------------------------------

def test_preset_shapes_are_the_published_ones() -> None:
    """The presets stand for published models (README and docs tables name them): their parameter counts are the
    published ones, and SmolLM2's is the real checkpoint's own shape, read from its GGUF file's metadata."""
    from transformers import AutoConfig

    from models.smollm2 import gguf_file

    real = AutoConfig.from_pretrained(gguf_file().parent, gguf_file=gguf_file().name)
    smollm2 = PRESETS["smollm2"]
    assert (smollm2.dim, smollm2.hidden, smollm2.layers, smollm2.heads, smollm2.kv_heads, smollm2.vocab) == (
        real.hidden_size, real.intermediate_size, real.num_hidden_layers, real.num_attention_heads,
        real.num_key_value_heads, real.vocab_size)
    # SmolLM2-360M, Llama-3.2-1B and the 135M / 271M Llama shapes of ExecuTorch's own benchmarks.
    assert [round(PRESETS[n].parameters / 1e9, 2) for n in ("134m", "271m", "360m", "1b")] == [0.13, 0.27, 0.36, 1.24]
    # Llama-3.2-3B, Llama-3.1-8B and Qwen3-4B's published parameter counts.
    assert [round(PRESETS[n].parameters / 1e9, 2) for n in ("3b", "8b", "qwen3-4b")] == [3.21, 8.03, 4.02]


@pytest.mark.parametrize("name", ["1b", "8b", "qwen3-4b", "lfm2-350m", "qwen3.5-0.8b"])
def test_both_exporters_build_a_preset_of_the_same_shape(name: str, tmp_path: Path) -> None:
    """Our exporter (from the preset's config.json) and export_llm (from its params.json) build models of the
    preset's parameter count, each on the meta device: a cost row compares the same model."""
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model_args import ModelArgs

    from benchmarks.presets import checkpoint_dir
    from models.checkpoint import build_model, open_checkpoint

    preset = PRESETS[name].with_layers(4)  # LFM2: conv, conv, attention, conv; Qwen3.5: 3 Gated DeltaNet, then attention
    ours = build_model(open_checkpoint(checkpoint_dir(preset, tmp_path), need_weights=False), 64, random_init=True,
                       device="meta")
    assert ours.args.qk_norm == (preset.family in ("qwen3", "lfm2", "qwen3_5")) and ours.args.head_dim == preset.head_dim
    kinds = {"conv": "short_conv", "linear_attention": "gated_delta", "full_attention": "attention"}
    assert [m.value for m in ours.args.layer_mixer] == [kinds[t] for t in preset.layer_types or ["full_attention"] * 4]
    with torch.device("meta"):
        theirs = construct_transformer(ModelArgs(max_seq_len=64, max_context_len=64, **preset.export_llm_params()))
    untied_copy = preset.vocab * preset.dim if preset.tied else 0  # export_llm stores a tied lm_head separately
    assert sum(p.numel() for p in ours.parameters()) == preset.parameters
    assert sum(p.numel() for p in theirs.parameters()) == preset.parameters + untied_copy
    # load_memory's default checkpoint: what the earlier script wrote for --size-mb 540 in bf16 (16 layers).
    assert PRESETS["271m"].scaled_to(540e6, 2) == PRESETS["271m"]


@pytest.mark.slow
def test_presets_tool_writes_a_checkpoint_folder_and_its_overrides(tmp_path: Path) -> None:
    assert "134m" in run_tool("presets").stdout
    overrides = run_tool("presets", "--preset", "tiny", "--out", tmp_path).stdout.split()
    assert overrides == ["model=llama", f"model.checkpoint={tmp_path / 'hf_config'}", "model.random_init=true"]
    config = json.loads((tmp_path / "hf_config" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (64, 2, 512)


# ---- benchmarks.export and benchmarks.cost_curve ----------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``benchmarks.export --preset tiny``: both exporters on the tiny shape, into ``<bench>/tiny``, once for every
    worker."""
    return shared_folder(tmp_path_factory, "bench", lambda f: run_tool(
        "export", "--preset", "tiny", "--out", f / "tiny", *SMALL, "--prefill-len", 8, "--decode-steps", 8,
        "--repeats", 1)) / "tiny"


@BENCHMARK_RUN
def test_bandwidth_bounds_each_program_by_the_bytes_a_decode_step_reads(tiny_bench: Path, tmp_path: Path) -> None:
    """``benchmarks.bandwidth`` on the tiny bench's two programs: read bandwidth before and after, the bytes per token
    from the program's own storage, and decode as a fraction of the bound."""
    out = tmp_path / "bw.json"
    run_tool("bandwidth", "--preset", "tiny", tiny_bench / "llm-exporters" / "model.pte",
             tiny_bench / "export_llm" / "model.pte", "--buffer-gb", 0.25, "--steps", 4, "--repeats", 1,
             "--position", 8, "--out", out)
    result = json.loads(out.read_text())
    bandwidth = max(result["bandwidth_before_gb_s"], result["bandwidth_after_gb_s"])
    assert bandwidth > 0 and len(result["bounds"]) == 2
    kv = 2 * PRESETS["tiny"].layers * PRESETS["tiny"].kv_dim * 4 * 8 / 1e6
    for bound in result["bounds"]:
        assert bound["bandwidth_gb_s"] == bandwidth and bound["weights_mb"] > 0 and bound["kv_mb"] == round(kv, 2)
        assert bound["bound_tok_s"] == pytest.approx(bandwidth * 1e9 / bound["bytes_per_token"], rel=0.01)
        assert 0 < bound["fraction"] == pytest.approx(bound["decode_tok_s"] / bound["bound_tok_s"], abs=0.001)


@BENCHMARK_RUN
def test_lowering_time_compares_a_shortcut_on_the_same_bytes(tmp_path: Path) -> None:
    out = tmp_path / "lowering.json"
    run_tool("lowering_time", "--preset", "tiny", "--max-seq-len", 32, "--shortcut", "copy-pass", "--out", out)
    result = json.loads(out.read_text())
    assert result["same_bytes"] and result["lower_s"]["off"][0] > 0 and result["lower_s"]["on"][0] > 0


@pytest.mark.extended  # 76 s, nearly all of it transformers' exporter (a peer's code): pytest -m extended
def test_export_benchmarks_transformers_own_exporter_as_a_peer(tmp_path: Path) -> None:
    """``--peers transformers`` on the real SmolLM2 cut to 2 layers: its two programs are exported, sized, loaded,
    timed and scored through its own runner, and the stock runner's verdict is recorded (it cannot load them)."""
    run_tool("export", "--preset", "smollm2", "--layers", 2, "--only", "transformers", "--peers", "transformers",
             "--out", tmp_path, *SMALL, "--prefill-len", 8, "--decode-steps", 8, "--ppl-tokens", 32)
    row = json.loads((tmp_path / "report.json").read_text())["results"]["transformers"]
    assert row["pte_mb"] > 0 and row["rss_after_load_mb"] > 0 and row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0
    assert 1 < row["perplexity"] < float("inf")
    assert row["stock_runner"].startswith("failed")
    refused = run_tool("export", "--preset", "tiny", "--only", "transformers", "--peers", "transformers",
                       "--out", tmp_path / "tiny", check=False)
    assert refused.returncode != 0 and "--preset smollm2" in refused.stderr


@BENCHMARK_RUN
def test_export_benchmarks_ours_against_export_llm(tiny_bench: Path) -> None:
    report = json.loads((tiny_bench / "report.json").read_text())
    assert report["preset"] == "tiny at max_seq_len 64" and report["parameters"] == PRESETS["tiny"].parameters
    assert set(report["results"]) == {"export_llm", "llm-exporters"}
    for row in report["results"].values():
        assert row["pte_mb"] > 0 and row["wall_s"] > 0 and row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0
    assert "emit" in report["results"]["llm-exporters"]["stages_s"]
    assert set(report["ours_over_export_llm"]) == {"wall_s", "peak_rss_gb", "pte_mb", "rss_after_load_mb",
                                                   "rss_after_load_no_cache_mb", "decode_tok_s", "prefill_tok_s"}
    ours = report["results"]["llm-exporters"]  # XNNPACK's weight cache on and off, and PSS
    assert ours["rss_after_load_no_cache_mb"] > 0 and ours["pss_after_load_mb"] > 0 and ours["decode_tok_s_no_cache"] > 0
    assert "| ratio ours/export_llm |" in (tiny_bench / "report.md").read_text()


@BENCHMARK_RUN
def test_cost_curve_tabulates_and_plots_bench_reports(tiny_bench: Path, tmp_path: Path) -> None:
    plot = tmp_path / "cost.png"
    out = run_tool("cost_curve", "--bench-dir", tiny_bench.parent, "--preset", "tiny", "--plot", plot).stdout
    assert "| tiny at max_seq_len 64 | 0M | 8da4w |" in out and plot.stat().st_size > 0
    missing = run_tool("cost_curve", "--bench-dir", tmp_path, "--preset", "1b", check=False)
    assert missing.returncode != 0 and f"--preset 1b --out {tmp_path / '1b'}" in missing.stderr


# ---- tools over one export or one program -----------------------------------------------------------------

@BENCHMARK_RUN
def test_generate_measures_the_python_loop(tmp_path: Path) -> None:
    out = run_tool("generate", "--preset", "tiny", *SMALL, "--out", tmp_path, "--quant", "fp32",
                   "--prompt-len", 8, "--steps", 8, "--repeats", 1).stdout
    assert "decode: bare loop" in out and "% of bare)" in out
    assert (tmp_path / "model.pte").is_file()


@pytest.mark.slow
def test_eager_quality_scores_baseline_and_quantized_eager_models() -> None:
    out = run_tool("eager_quality", "--preset", "tiny", *SMALL, "validation.max_tokens=32").stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("unquantized (bf16)") and "32 tokens of" in lines[0]  # random weights are made in bf16
    assert [line.split()[2] for line in lines[1:]] == ["hqq", "affine", "gptq"]
    assert "calibrated on" in lines[3]  # what the quantize stage did, as the manifest says it
    assert all("perplexity" in line for line in lines)
    for line in lines[1:]:  # what each costs against the unquantized model, position by position
        kl, top1 = re.search(r"KL to unquantized ([0-9.]+), top-1 ([0-9.]+)%", line).groups()
        assert 0 < float(kl) < 1 and 0 < float(top1) <= 100


def test_embedding_lookup_measures_both_lookups() -> None:
    out = run_tool("embedding_lookup", "--rows", 4096, "--dim", 64).stdout
    rows = re.findall(r"(torchao's lookup|models.decoder.Embedding) +peak \+([0-9,]+) MB, ([0-9.,]+) ms", out)
    assert [name for name, _, _ in rows] == ["torchao's lookup", "models.decoder.Embedding"], out


@pytest.mark.slow
def test_load_memory_measures_a_sharded_checkpoint() -> None:
    result = json.loads(run_tool("load_memory", "--preset", "tiny", "--shards", 2).stdout.strip().splitlines()[-1])
    assert result["checkpoint_bytes"] == 2 * PRESETS["tiny"].parameters  # bf16
    assert result["model_param_bytes"] == result["checkpoint_bytes"]
    assert result["peak_rss_weights_resident"] >= result["rss_before_loading"] > 0


@BENCHMARK_RUN
def test_profile_memory_reports_each_stage_and_emit_step() -> None:
    out = run_tool("profile_memory", "--preset", "tiny", *SMALL).stdout
    stages = [line.split()[0] for line in out.splitlines() if "after returning freed heap" in line]
    assert stages == ["load", "quantize", "capture", "lower", "emit", "finalize"]
    for step in ("emit_program", "write_atomically", "storage_breakdown", "sha256_of"):
        assert f"    {step} " in out
    assert "not probed" not in out


@BENCHMARK_RUN
def test_profile_ops_profiles_in_this_runtime_and_says_when_another_is_missing(tmp_path: Path) -> None:
    """This project's runtime (ExecuTorch 1.5.1's pip wheel) has the event tracer: the tool exports the preset and
    profiles it here; a --runtime-python that does not exist is named."""
    absent = run_tool("profile_ops", "ours=x.pte", "--runtime-python", tmp_path / "nope" / "python", check=False)
    assert absent.returncode != 0 and f"--runtime-python {tmp_path / 'nope' / 'python'}: no such interpreter" in absent.stderr
    out = run_tool("profile_ops", "--preset", "tiny", *SMALL, "--out", tmp_path, "--prompt-tokens", 8,
                   "--steps", 4).stdout
    assert (tmp_path / "model.pte").is_file()
    assert "| per decode step | ours |" in out and "| time in delegate calls |" in out
    assert "| operator (ms per decode step) | ours |" in out


def speedscope(stacks: list[list[str]]) -> dict:
    names = sorted({name for stack in stacks for name in stack})
    return {"shared": {"frames": [{"name": n, "file": f"/x/site-packages/{n}.py"} for n in names]},
            "profiles": [{"samples": [[names.index(n) for n in stack] for stack in stacks]}]}


@pytest.mark.slow
def test_pyspy_summary_summarizes_a_profile(tmp_path: Path) -> None:
    profile = tmp_path / "export.json"
    profile.write_text(json.dumps(speedscope([["main", "LowerStage.run", "_quantize_affine"],
                                              ["main", "LowerStage.run"], ["main", "EmitStage.run"],
                                              ["main", "LowerStage.run", "_quantize_affine"]])))
    out = run_tool("pyspy_summary", profile).stdout
    assert out.splitlines()[:2] == ["4 samples", "100.0%  main (main.py)"]
    within = run_tool("pyspy_summary", profile, "--within", "LowerStage.run", "--inside", "_quantize_affine").stdout
    assert within.strip() == "LowerStage.run: 75.0% of all samples; 67% of them under _quantize_affine"


@BENCHMARK_RUN
def test_pyspy_summary_records_an_export_of_a_preset(tmp_path: Path) -> None:
    if not ((Path(sys.executable).parent / "py-spy").is_file() or shutil.which("py-spy")):
        pytest.skip("py-spy is not installed (pip install py-spy)")
    out = run_tool("pyspy_summary", "--preset", "tiny", *SMALL, "--out", tmp_path, "--top", 5).stdout
    assert (tmp_path / "export.json").is_file() and (tmp_path / "export" / "model.pte").is_file()
    assert " samples" in out and "exporters/llm.py" in out


# ---- sweeps -----------------------------------------------------------------------------------------------

@BENCHMARK_RUN
def test_sweep_launchers_compares_launchers(tmp_path: Path) -> None:
    """The serial launcher only: the launchers themselves are tests/test_sweeps.py's."""
    out = run_tool("sweep_launchers", "--out", tmp_path, "--launchers", "serial", "--preset", "tiny",
                   "quant=fp32", "export.max_seq_len=64", "validation.max_tokens=24").stdout
    table = (tmp_path / "launchers.md").read_text()
    assert "| serial |" in table and table.count("| 1/1 |") == 1, out
    assert (tmp_path / "serial" / "summary.md").is_file()


def compose_experiment(name: str, *overrides: str, hydra: bool = False):  # type: ignore[no-untyped-def]
    return compose(f"+experiment={name}", *overrides, return_hydra_config=hydra)


@pytest.mark.parametrize("name", ["quant_quality", "size_table"])
def test_sweep_presets_compose(name: str) -> None:
    overrides = ["model.checkpoint=/some/checkpoint"] if name == "quant_quality" else []
    cfg = to_typed(compose_experiment(name, *overrides))
    assert cfg.backend.name == "xnnpack" and cfg.bench is False and cfg.validate
    params = compose_experiment(name, *overrides, hydra=True).hydra.sweeper.params
    calibrated = ["8da4w_calibrated"] if name == "quant_quality" else []  # quality, not the size table's concern
    assert params.quant.split(",") == ["fp32", "fp16", "bf16", "8da8w", "8da4w", *calibrated, "8da4w_emb4w"]


def test_size_table_is_the_134m_preset() -> None:
    cfg = compose_experiment("size_table")
    shape = [f"model={cfg.model.name}", f"model.random_init={str(cfg.model.random_init).lower()}",
             *(f"model.arch.{k}={v if not isinstance(v, bool) else str(v).lower()}"
               for k, v in cfg.model.arch.items() if v is not None)]
    assert sorted(shape) == sorted(PRESETS["134m"].arch_overrides())
    ex = cfg.export
    assert (ex.max_seq_len, list(ex.methods), ex.layout) == (256, ["prefill", "decode"], "split")


@BENCHMARK_RUN
def test_quant_quality_sweep_writes_its_summary(tmp_path: Path) -> None:
    """One job of the preset (the sweep machinery itself is tests/test_sweeps.py's)."""
    run_sweep(tmp_path, "+experiment=quant_quality", "model=tiny", "validation.max_tokens=24", "export.max_seq_len=64",
              "quant=8da4w")
    rows = read_rows(tmp_path)
    assert [(r.quant, r.status) for r in rows] == [("8da4w", "ok")]
    assert all(r.perplexity and r.ppl_increase is not None and r.kl_mean is not None for r in rows)
    assert all(r.decode_tok_s is None for r in rows)  # bench=false
    assert "1 of 1 jobs ok" in (tmp_path / "summary.md").read_text()


def test_the_mixed_precision_search_composes_over_budget_and_algorithm() -> None:
    """conf/search_mixed.yaml: Optuna's space adds quant.size_budget and the calibrated preset to search.yaml's,
    and every config it can pick is one the schema accepts."""
    from exporters.export import checked_config

    hydra = compose(config_name="search_mixed", return_hydra_config=True).hydra
    params = hydra.sweeper.params
    assert hydra.sweeper.direction == "minimize" and params.quant == "8da4w,8da4w_calibrated"
    assert params["quant.size_budget"] == "interval(1.0, 1.15)"
    assert "quant.group_size" in params  # search.yaml's space is kept
    for quant in params.quant.split(","):
        for budget in ("1.0", "1.15"):
            cfg = checked_config(compose(f"quant={quant}", f"quant.size_budget={budget}", config_name="search_mixed"))
            assert cfg.quant.size_budget == float(budget)


def test_proposal_cost_breaks_even_where_a_rounds_tokens_pay_for_its_time() -> None:
    """benchmarks.proposal_cost's arithmetic (its run on a program: tests/test_gemma4_drafter.py): a round of K
    proposals yields 1 to K + 1 tokens; it breaks even where those tokens take the step method's time."""
    from benchmarks.proposal_cost import break_even, tokens_per_round

    assert tokens_per_round(0.0, 4) == 1 and tokens_per_round(1.0, 4) == 5
    assert abs(tokens_per_round(0.5, 2) - 1.75) < 1e-12  # 1 + 0.5 + 0.25
    assert break_even(step_ms=10, round_ms=17.5, k=2) == 0.5
    assert break_even(step_ms=10, round_ms=60, k=4) is None  # even five tokens a round take longer
    assert break_even(step_ms=10, round_ms=5, k=4) == 0.0  # faster than one step: pays whatever is kept
