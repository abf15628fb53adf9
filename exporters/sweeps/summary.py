"""The summary of a sweep: one row per job, as ``summary.csv``, ``summary.md`` and ``pareto.png``.

Every job writes its own ``result.json`` into its folder (``exporters.sweeps.job``), wherever it ran; this module
gathers them. A job folder without one (the job was killed, or the sweep was interrupted) is a ``failed``
row built from the folder's ``.hydra/`` files. Hydra calls :func:`write_summary` at the end of every ``-m``
run (``exporters.sweeps.callbacks.SweepSummary``); ``python -m exporters.report <sweep folder>`` rebuilds the
three files from the job folders, e.g. for a sweep that was interrupted or ran on a cluster.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal

import yaml

from exporters.errors import check_choice
from exporters.manifest import Manifest

if TYPE_CHECKING:
    from exporters.config import SearchConfig


RESULT_FILE = "result.json"
SUMMARY_FILES = ("summary.csv", "summary.md", "pareto.png")


def numeric_columns() -> list[str]:
    """The columns an Optuna search can optimize (``search.objective``)."""
    return [f.name for f in fields(JobRow) if "float" in str(f.type)]


def check_search(search: SearchConfig) -> None:
    check_choice("search.objective", search.objective, numeric_columns(), "Pick a numeric column of the sweep summary.")


@dataclass
class JobRow:
    """One job of a sweep: what it was, whether it worked, and its measures (None = not measured)."""

    job: int
    overrides: str  # the job's own overrides, as typed on the command line
    model: str
    quant: str
    backend: str
    status: Literal["ok", "failed"]
    reason: str = ""  # why it failed
    size_mb: float | None = None  # what an app ships: the program, and its data file with export.weights=external
    data_mb: float | None = None  # the data file alone (export.weights=external)
    export_s: float | None = None  # the export itself (every stage before finalize)
    peak_rss_mb: float | None = None  # of the export; for a killed job, of its process until it died
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    rss_after_load_mb: float | None = None
    perplexity: float | None = None  # of the program on the validation text
    baseline_perplexity: float | None = None  # of the unquantized model, as loaded, on the same tokens
    ppl_increase: float | None = None  # perplexity / baseline_perplexity - 1: the quality loss
    kl_mean: float | None = None  # validation: KL(eager quantized || program), nats per token
    top1_agreement: float | None = None  # validation: share of positions with the eager model's greedy token
    # validation: the program against the unquantized model (what the export costs in all), as the two above
    kl_vs_unquantized: float | None = None
    top1_vs_unquantized: float | None = None
    job_s: float | None = None  # the whole job: process start, export, validation, bench
    program: str = ""  # the .pte, relative to the sweep folder

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def with_manifest(self, manifest: Manifest, program: str) -> "JobRow":
        """This row with the measures a job's ``manifest.json`` holds."""
        m = manifest
        data_bytes = m.data.size_bytes if m.data else 0
        values: dict[str, Any] = {"size_mb": (m.program.size_bytes + data_bytes) / 1e6, "program": program,
                                  "data_mb": data_bytes / 1e6 if m.data else None,
                                  "export_s": m.resources.wall_s, "peak_rss_mb": m.resources.peak_rss_mb}
        if m.bench:
            values.update(prefill_tok_s=m.bench.prefill_tokens_per_s, decode_tok_s=m.bench.decode_tokens_per_s,
                          rss_after_load_mb=m.bench.rss_after_load_mb)
        if m.validation:
            v = m.validation
            values.update(perplexity=v.perplexity, baseline_perplexity=v.baseline_perplexity,
                          ppl_increase=v.ppl_increase, kl_mean=v.kl_mean, top1_agreement=v.top1_agreement,
                          kl_vs_unquantized=v.kl_vs_unquantized, top1_vs_unquantized=v.top1_vs_unquantized)
        return JobRow(**{**asdict(self), **values})


def labels(rows: list[JobRow]) -> dict[int, str]:
    """What tells each job apart: its overrides minus those every job shares (the checkpoint, say)."""
    shared = set.intersection(*(set(r.overrides.split()) for r in rows)) if rows else set()
    own = {r.job: [o for o in r.overrides.split() if o not in shared] for r in rows}
    keys = {o.split("=")[0] for overrides in own.values() for o in overrides}
    if len(keys) == 1 and all(len(overrides) == 1 for overrides in own.values()):  # quant=fp32 -> fp32
        own = {job: [o.split("=", 1)[1] for o in overrides] for job, overrides in own.items()}
    return {r.job: " ".join(own[r.job]) or f"{r.model} {r.quant} {r.backend}" for r in rows}


def write_result(job_dir: Path, row: JobRow) -> None:
    (job_dir / RESULT_FILE).write_text(json.dumps(asdict(row), indent=2) + "\n")


def job_folders(sweep_dir: Path) -> Iterable[Path]:
    """Folders Hydra made for jobs: each has ``.hydra/`` (written when the job starts) or a result."""
    for folder in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        if (folder / RESULT_FILE).is_file() or (folder / ".hydra" / "config.yaml").is_file():
            yield folder


def unfinished_row(job_dir: Path) -> JobRow:
    """A job that left no result: what it was, from the files Hydra wrote when it started."""
    hydra_dir = job_dir / ".hydra"
    cfg = yaml.safe_load((hydra_dir / "config.yaml").read_text())
    hydra_cfg = yaml.safe_load((hydra_dir / "hydra.yaml").read_text())["hydra"]
    overrides = yaml.safe_load((hydra_dir / "overrides.yaml").read_text()) or []
    return JobRow(job=int(hydra_cfg["job"]["num"]), overrides=" ".join(overrides), model=cfg["model"]["name"],
                  quant=cfg["quant"]["name"], backend=cfg["backend"]["name"], status="failed",
                  reason="the job left no result: it was killed (e.g. by the out-of-memory killer) or is still "
                         "running; its llm.log says how far it got")


def row_from_json(data: dict[str, Any]) -> JobRow:
    """A job's row from its ``result.json``; rows written by 0.1 named the baseline's perplexity fp32_perplexity."""
    if "fp32_perplexity" in data:
        data = {("baseline_perplexity" if k == "fp32_perplexity" else k): v for k, v in data.items()}
    return JobRow(**data)


def read_rows(sweep_dir: Path) -> list[JobRow]:
    rows = []
    for folder in job_folders(sweep_dir):
        result = folder / RESULT_FILE
        rows.append(row_from_json(json.loads(result.read_text())) if result.is_file() else unfinished_row(folder))
    return sorted(rows, key=lambda r: r.job)


# ---- Pareto fronts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tradeoff:
    """Quality loss (perplexity increase over the unquantized model, lower is better) against one cost or benefit."""

    name: str
    column: str
    axis: str
    higher_is_better: bool


TRADEOFFS = (Tradeoff("size", "size_mb", "size (MB: .pte, with its .ptd if any)", higher_is_better=False),
             Tradeoff("speed", "decode_tok_s", "decode speed (tokens/s)", higher_is_better=True))


def pareto_front(rows: list[JobRow], tradeoff: Tradeoff) -> list[JobRow]:
    """Rows no other row beats on both quality loss and ``tradeoff`` (ties kept)."""
    def key(r: JobRow) -> tuple[float, float]:
        value = getattr(r, tradeoff.column)
        return (-value if tradeoff.higher_is_better else value, r.ppl_increase)  # type: ignore[return-value]

    measured = [r for r in rows if r.ok and getattr(r, tradeoff.column) is not None and r.ppl_increase is not None]
    return [r for r in measured
            if not any(all(a <= b for a, b in zip(key(o), key(r))) and key(o) != key(r) for o in measured)]


# ---- Writers ------------------------------------------------------------------------------------------

def write_csv(rows: list[JobRow], path: Path) -> None:
    names = [f.name for f in fields(JobRow)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in asdict(row).items()})


def _cell(value: float | None, fmt: Callable[[float], str]) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt(value)


@dataclass(frozen=True)
class Column:
    """A numeric column of ``summary.md``: its header, the row field, and how a value is written."""

    header: str
    field: str
    fmt: str  # a str.format spec applied to the value


COLUMNS = (
    Column("size MB", "size_mb", "{:.1f}"), Column("export s", "export_s", "{:.0f}"),
    Column("peak RSS MB", "peak_rss_mb", "{:.0f}"), Column("prefill tok/s", "prefill_tok_s", "{:.0f}"),
    Column("decode tok/s", "decode_tok_s", "{:.0f}"), Column("RSS after load MB", "rss_after_load_mb", "{:.0f}"),
    Column("perplexity", "perplexity", "{:.2f}"), Column("unquantized", "baseline_perplexity", "{:.2f}"),
    Column("increase", "ppl_increase", "{:+.1%}"), Column("KL", "kl_mean", "{:.2g}"),
    Column("top-1", "top1_agreement", "{:.0%}"), Column("KL vs unquantized", "kl_vs_unquantized", "{:.2g}"),
    Column("top-1 vs unquantized", "top1_vs_unquantized", "{:.0%}"),
)


def _table(headers: list[str], aligns: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table; ``aligns`` holds "---:" (numbers) or "---" (text) per column."""
    return ["| " + " | ".join(headers) + " |", "|" + "|".join(aligns) + "|",
            *("| " + " | ".join(cells) + " |" for cells in rows)]


def write_markdown(rows: list[JobRow], path: Path, sweep_dir: Path) -> None:
    """Working configs smallest first, each marked where it is on a Pareto front; failed ones after."""
    fronts = {t.name: {r.job for r in pareto_front(rows, t)} for t in TRADEOFFS}
    label = labels(rows)
    ok = sorted((r for r in rows if r.ok), key=lambda r: (r.size_mb is None, r.size_mb or 0.0))
    failed = [r for r in rows if not r.ok]

    def best(r: JobRow) -> str:
        marks = ", ".join(name for name, jobs in fronts.items() if r.job in jobs)
        return f"**{marks}**" if marks else ""

    lines = [
        f"# Sweep summary: {sweep_dir}",
        "",
        f"{len(ok)} of {len(rows)} jobs ok. Smallest first. **best** marks the Pareto front of quality loss "
        "(perplexity increase over the unquantized model) against size (`size`) and against decode speed "
        "(`speed`): no other config is both better there and no worse in quality.",
        "",
        *_table(["job", "config", "best", *(c.header for c in COLUMNS)], ["---:", "---", "---", *["---:"] * len(COLUMNS)],
                [[str(r.job), label[r.job], best(r), *(_cell(getattr(r, c.field), c.fmt.format) for c in COLUMNS)]
                 for r in ok]),
    ]
    if failed:
        lines += ["", "## Failed", ""]
        lines += _table(["job", "config", "reason"], ["---:", "---", "---"],
                        [[str(r.job), label[r.job], r.reason.replace("|", "/").replace(chr(10), " ")] for r in failed])
    path.write_text("\n".join(lines) + "\n")


def write_pareto_plot(rows: list[JobRow], path: Path) -> None:
    """Quality loss against size and against decode speed, fronts highlighted, points labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = labels(rows)
    fig, axes = plt.subplots(1, len(TRADEOFFS), figsize=(6 * len(TRADEOFFS), 4.5))
    for ax, tradeoff in zip(axes, TRADEOFFS):
        points = [r for r in rows if r.ok and getattr(r, tradeoff.column) is not None and r.ppl_increase is not None]
        front = sorted(pareto_front(rows, tradeoff), key=lambda r: getattr(r, tradeoff.column))
        ax.scatter([getattr(r, tradeoff.column) for r in points], [100 * r.ppl_increase for r in points],  # type: ignore[operator]
                   color="tab:gray", label="config")
        ax.plot([getattr(r, tradeoff.column) for r in front], [100 * r.ppl_increase for r in front],  # type: ignore[operator]
                "o-", color="tab:red", label="Pareto front")
        for r in points:
            ax.annotate(label[r.job], (getattr(r, tradeoff.column), 100 * r.ppl_increase), fontsize=7,  # type: ignore[operator]
                        textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel(tradeoff.axis + (" (higher is better)" if tradeoff.higher_is_better else ""))
        ax.set_ylabel("perplexity increase over the unquantized model (%)")
        ax.grid(alpha=0.3)
        if not points:
            ax.text(0.5, 0.5, "no job has both measures", ha="center", va="center", transform=ax.transAxes)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle("Quality loss against size and speed (lower left / lower right is better)")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_summary(sweep_dir: str | Path) -> list[JobRow]:
    """Gather the job folders of ``sweep_dir`` and (re)write ``summary.csv``, ``summary.md`` and ``pareto.png``."""
    sweep = Path(sweep_dir)
    rows = read_rows(sweep)
    write_csv(rows, sweep / "summary.csv")
    write_markdown(rows, sweep / "summary.md", sweep)
    write_pareto_plot(rows, sweep / "pareto.png")
    return rows
