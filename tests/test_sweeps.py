"""Sweeps as users run them: ``python -m exporters.llm -m`` with the real launchers (joblib, Ray, submitit)
and the Optuna sweeper, real tiny exports validated and benchmarked in the runtime, and the summary Hydra's
end-of-sweep callback writes."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

pytestmark = pytest.mark.slow  # every test here exports, sweeps or builds

REPO = Path(__file__).resolve().parent.parent
# Three configs, one of which cannot work (xnnpack has no 4w linear kernel); small validation and bench.
GRID = ["quant=fp32,fp16,4w"]
QUICK = ["export.methods=[decode]", "export.layout=split", "validation.max_tokens=24", "benchmark.prompt_tokens=16",
         "benchmark.steps=16", "benchmark.repeats=1"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sweep_cmd(sweep_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "exporters.llm", "-m", *overrides, *QUICK, f"hydra.sweep.dir={sweep_dir}"]


def run_sweep(sweep_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(sweep_cmd(sweep_dir, *overrides), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def summary_rows(sweep_dir: Path) -> dict[str, dict[str, str]]:
    with open(sweep_dir / "summary.csv") as f:
        return {row["quant"]: row for row in csv.DictReader(f)}


def assert_measured(row: dict[str, str]) -> None:
    """An ok row carries every measure: size, export, runtime speed and memory, quality."""
    assert row["status"] == "ok", row
    for column in ("size_mb", "export_s", "peak_rss_mb", "prefill_tok_s", "decode_tok_s", "rss_after_load_mb",
                   "perplexity", "baseline_perplexity", "ppl_increase", "kl_mean", "top1_agreement", "kl_vs_unquantized",
                   "top1_vs_unquantized", "job_s"):
        assert row[column] != "" and float(row[column]) == float(row[column]), (column, row)
    assert float(row["size_mb"]) > 0 and float(row["decode_tok_s"]) > 0 and float(row["peak_rss_mb"]) > 100


def assert_three_rows(sweep_dir: Path, killed: str | None = None) -> dict[str, dict[str, str]]:
    """GRID's rows (and the row of a ``killed`` job): fp32 and fp16 measured, 4w failed with the reason."""
    rows = summary_rows(sweep_dir)
    assert sorted(rows) == sorted(["4w", "fp16", "fp32", *([killed] if killed else [])])
    assert_measured(rows["fp32"])
    assert_measured(rows["fp16"])
    assert float(rows["fp16"]["size_mb"]) < float(rows["fp32"]["size_mb"])
    failed = rows["4w"]
    assert failed["status"] == "failed" and "cannot run" in failed["reason"] and failed["size_mb"] == ""
    # The .pte a row names is the validated program in that job's folder.
    assert (sweep_dir / rows["fp32"]["program"]).is_file()
    markdown = (sweep_dir / "summary.md").read_text()
    assert f"2 of {len(rows)} jobs ok" in markdown and "## Failed" in markdown and "**" in markdown
    assert (sweep_dir / "pareto.png").read_bytes()[:8] == PNG_MAGIC
    return rows


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder with a short path: Ray's unix sockets live under the sweep folder and may not exceed 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="sw", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_joblib_sweep_writes_a_row_per_job_and_the_report_rebuilds_it(tmp_path: Path) -> None:
    """Four jobs, two at a time: two measured, one that cannot run (4w), and one killed with SIGKILL while it exports
    (as the out-of-memory killer would), whose row says so while the others finish; the summary is then rebuilt
    from the job folders alone."""
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(sweep_cmd(sweep, "hydra/launcher=local_parallel", "hydra.launcher.n_jobs=2",
                                      f"{GRID[0]},8da8w"), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    killed = sweep / "3-tiny-8da8w-xnnpack"
    victim, deadline = None, time.monotonic() + 600
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        victim = _export_process_of(killed)
        time.sleep(0.2)
    assert victim is not None, "job 3's export process never appeared"
    time.sleep(3)  # let it get into its export (what the out-of-memory killer would interrupt)
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    assert "sweep: 4 jobs, 2 ok, 2 failed" in out
    rows = assert_three_rows(sweep, killed="8da8w")
    assert rows["8da8w"]["status"] == "failed" and "SIGKILL" in rows["8da8w"]["reason"], rows["8da8w"]
    assert rows["8da8w"]["peak_rss_mb"] != ""  # how far its memory got before it died
    assert not (killed / "model.pte").exists()
    # Each job's row is in its own folder; the summary is rebuilt from those alone.
    before = (sweep / "summary.csv").read_text()
    for name in ("summary.csv", "summary.md", "pareto.png"):
        (sweep / name).unlink()
    report = subprocess.run([sys.executable, "-m", "exporters.report", str(sweep)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    assert "4 jobs (2 ok, 2 failed)" in report.stdout
    assert (sweep / "summary.csv").read_text() == before
    assert (sweep / "pareto.png").read_bytes()[:8] == PNG_MAGIC
    manifest = json.loads((sweep / rows["fp32"]["program"]).with_name("manifest.json").read_text())
    assert manifest["bench"]["steps"] == 16 and manifest["resources"]["peak_rss_mb"] > 0


def test_report_of_a_folder_that_is_no_sweep_says_so(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "exporters.report", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "holds no job folders" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.extended  # the launcher's own machinery on top of the joblib sweep's jobs: pytest -m extended
def test_ray_sweep_on_a_local_cluster(short_tmp: Path) -> None:
    sweep = short_tmp / "sweep"
    run_sweep(sweep, "hydra/launcher=ray_cluster", *GRID)
    assert_three_rows(sweep)
    assert (sweep / ".ray").is_dir()  # Ray's temporary files stay in the sweep folder


@pytest.mark.extended  # the launcher's own machinery on top of the joblib sweep's jobs: pytest -m extended
def test_submitit_local_sweep(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run_sweep(sweep, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=15", "quant=fp32,4w")
    rows = summary_rows(sweep)
    assert_measured(rows["fp32"])
    assert rows["4w"]["status"] == "failed"


def _export_process_of(job_dir: Path) -> int | None:
    """The pid of the child process exporting into ``job_dir`` (``python -m exporters.sweeps.job <job_dir>``)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"exporters.sweeps.job" in cmdline and str(job_dir).encode() in cmdline:
                return int(proc.name)
    return None


# The sweeper's own machinery on top of the joblib sweep's jobs (its config composes in tests/test_config.py, in every
# run): pytest -m extended, as Ray's and submitit's launchers; out of the full run for its time (about 50 s).
@pytest.mark.extended
def test_optuna_search_returns_the_smallest_program_within_the_quality_bound(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # Two trials over two schemes, both fine on the tiny model; Optuna minimizes the .pte size, which needs no
    # benchmark (the grid sweeps above measure the runtime's columns).
    run_sweep(sweep, "--config-name", "search", "hydra.sweeper.n_trials=2",
              "hydra.sweeper.params.quant='fp32,fp16'", "search.max_ppl_increase=0.5", "bench=false")
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(float(r["size_mb"]) for r in rows))
