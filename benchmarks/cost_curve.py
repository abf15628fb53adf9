"""Export cost against model size, from the reports of ``python -m benchmarks.export`` runs.

    python -m benchmarks.cost_curve bench/smollm2 bench/360m bench/1b --plot docs/cost_curve.png
    python -m benchmarks.cost_curve --bench-dir bench --preset smollm2 360m 1b --plot docs/cost_curve.png

Each run is a folder holding a ``report.json``; ``--preset NAME ...`` names the folders ``<bench-dir>/<NAME>``
(where ``python -m benchmarks.export --preset NAME --out <bench-dir>/<NAME>`` writes). Prints a markdown table
(parameters, wall time, peak RSS, .pte size for each exporter) and draws the same three quantities against
parameter count, one line per exporter (matplotlib: ``pip install -e ".[bench]"``). An export that failed (export_llm
killed by the out-of-memory killer at 8B) is listed under the table and drawn as an x where it stopped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.presets import PRESETS

QUANTITIES = (("wall_s", "export wall time (s)"), ("peak_rss_gb", "peak RSS (GB)"), ("pte_mb", ".pte size (MB)"))


def read_reports(runs: list[Path]) -> list[dict]:
    """The runs' report.json files, smallest model first."""
    missing = [run for run in runs if not (run / "report.json").is_file()]
    if missing:
        raise SystemExit("no report.json in " + ", ".join(map(str, missing)) + ": run "
                         "python -m benchmarks.export --preset NAME --out <folder> first.")
    return sorted((json.loads((run / "report.json").read_text()) for run in runs), key=lambda r: r["parameters"])


def table(reports: list[dict]) -> str:
    exporters = sorted({name for r in reports for name in r["results"]})
    lines = ["| model | parameters | quant | " + " | ".join(
        f"{e} {label.split(' (')[0]}" for e in exporters for _, label in QUANTITIES) + " |",
        "|" + "---|" * (3 + len(exporters) * len(QUANTITIES))]
    for r in reports:
        cells = [cell(r["results"].get(e, {}), key) for e in exporters for key, _ in QUANTITIES]
        lines.append(f"| {r['preset']} | {r['parameters'] / 1e6:.0f}M | {r['quant']} | " + " | ".join(cells) + " |")
    failures = [f"- {r['preset']}: {e} {row['failed']} after {row['wall_s']} s at {row['peak_rss_gb']} GB peak RSS"
                for r in reports for e, row in sorted(r["results"].items()) if "failed" in row]
    return "\n".join(lines + (["", "Failed exports:", *failures] if failures else []))


def cell(row: dict, key: str) -> str:
    """A table cell: the value; for a failed export its wall time and peak marked as the failure's ("x"), no size."""
    if "failed" in row:
        return f"x {row[key]}" if key in row else "failed"
    return str(row.get(key, "—"))


def plot(reports: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exporters = sorted({name for r in reports for name in r["results"]})
    fig, axes = plt.subplots(1, len(QUANTITIES), figsize=(4.2 * len(QUANTITIES), 3.6))
    for ax, (key, label) in zip(axes, QUANTITIES):
        for e in exporters:
            done = [r for r in reports if e in r["results"] and "failed" not in r["results"][e]]
            line = ax.plot([r["parameters"] / 1e6 for r in done], [r["results"][e][key] for r in done], marker="o",
                           label=e)[0]
            failed = [r for r in reports if key in r["results"].get(e, {}) and "failed" in r["results"][e]]
            if failed:  # where a failed export stopped: its wall time and peak RSS when it was killed
                ax.scatter([r["parameters"] / 1e6 for r in failed], [r["results"][e][key] for r in failed], marker="x",
                           s=60, color=line.get_color(), label=f"{e} failed" if key == QUANTITIES[0][0] else None)
            for r in reports:
                if r in done and e == exporters[-1]:
                    ax.annotate(f"{r['preset']} {r['quant']}", (r["parameters"] / 1e6, r["results"][e][key]),
                                fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].legend(loc="lower right", fontsize=8)  # the size plot has room there
    fig.suptitle("Export cost against model size (xnnpack, this 2-core machine)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", type=Path, help="folders holding report.json")
    ap.add_argument("--preset", nargs="+", default=[], choices=list(PRESETS), metavar="NAME",
                    help="also the runs <bench-dir>/<NAME> (presets: " + ", ".join(PRESETS) + ")")
    ap.add_argument("--bench-dir", type=Path, default=Path("bench"), help="where --preset looks (default bench/)")
    ap.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    args = ap.parse_args()
    for name in args.preset:
        if not (args.bench_dir / name / "report.json").is_file():
            raise SystemExit(f"no report.json in {args.bench_dir / name}: run "
                             f"python -m benchmarks.export --preset {name} --out {args.bench_dir / name} first.")
    runs = [*args.runs, *(args.bench_dir / name for name in args.preset)]
    if not runs:
        ap.error("give run folders, or --preset NAME ... (with --bench-dir)")
    reports = read_reports(runs)
    print(table(reports))
    if args.plot:
        plot(reports, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
