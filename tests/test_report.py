"""The sweep summary's logic on rows with known numbers: Pareto fronts, labels, failed rows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from exporters.sweeps.summary import (TRADEOFFS, JobRow, labels, pareto_front, read_rows, row_from_json, write_result,
                                      write_summary)

SIZE, SPEED = TRADEOFFS


def row(job: int, quant: str, size: float, speed: float, loss: float) -> JobRow:
    return JobRow(job=job, overrides=f"model.checkpoint=/m quant={quant}", model="hf", quant=quant, backend="xnnpack",
                  status="ok", size_mb=size, decode_tok_s=speed, ppl_increase=loss)


ROWS = [row(0, "fp32", 540.0, 60.0, 0.0), row(1, "fp16", 270.0, 90.0, 0.0), row(2, "8da8w", 160.0, 150.0, 0.04),
        row(3, "8da4w", 110.0, 170.0, 0.25), row(4, "worse", 120.0, 100.0, 0.30)]


def test_pareto_front_keeps_only_configs_nothing_beats_on_both() -> None:
    # fp32 ties fp16 on quality but is larger and slower: fp16 dominates it. "worse" loses to 8da4w on all.
    assert [r.quant for r in pareto_front(ROWS, SIZE)] == ["fp16", "8da8w", "8da4w"]
    assert [r.quant for r in pareto_front(ROWS, SPEED)] == ["fp16", "8da8w", "8da4w"]
    failed = JobRow(job=5, overrides="quant=x", model="hf", quant="x", backend="xnnpack", status="failed", reason="r")
    assert failed not in pareto_front([*ROWS, failed], SIZE)


def test_labels_drop_what_every_job_shares() -> None:
    assert labels(ROWS)[3] == "8da4w"  # one key varies: its value says it all
    extra = dataclasses.replace(ROWS[0], job=9, overrides="model.checkpoint=/m quant=fp32 x=1")
    assert labels([*ROWS, extra])[9] == "quant=fp32 x=1"  # two keys vary: both named


def test_summary_marks_the_front_and_lists_failed_jobs_with_their_reason(tmp_path: Path) -> None:
    for r in ROWS:
        (tmp_path / f"{r.job}-job").mkdir()
        write_result(tmp_path / f"{r.job}-job", r)
    killed = tmp_path / "5-job" / ".hydra"  # a job that started and left no result.json
    killed.mkdir(parents=True)
    (killed / "config.yaml").write_text("model: {name: hf}\nquant: {name: 8da4w_emb4w}\nbackend: {name: xnnpack}\n")
    (killed / "hydra.yaml").write_text("hydra: {job: {num: 5}}\n")
    (killed / "overrides.yaml").write_text("- model.checkpoint=/m\n- quant=8da4w_emb4w\n")
    rows = write_summary(tmp_path)
    assert [r.job for r in rows] == [0, 1, 2, 3, 4, 5] and rows[5].status == "failed"
    assert "killed" in rows[5].reason
    md = (tmp_path / "summary.md").read_text()
    assert "| 3 | 8da4w | **size, speed** |" in md and "| 4 | worse |  |" in md
    assert "| 5 | 8da4w_emb4w | the job left no result" in md
    assert read_rows(tmp_path) == rows


def test_a_row_written_by_0_1_names_the_baseline_as_it_is_named_now() -> None:
    old = {**dataclasses.asdict(row(0, "8da4w", 110.0, 170.0, 0.25)), "perplexity": 27.1}
    old["fp32_perplexity"] = old.pop("baseline_perplexity") or 21.7
    assert row_from_json(old).baseline_perplexity == 21.7
