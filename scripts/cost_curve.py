"""Export cost against model size, from the reports of ``scripts/bench_export.py`` runs.

    python scripts/cost_curve.py /tmp/bench_smol /tmp/bench_1b [...] --plot docs/cost_curve.png

Prints a markdown table (parameters, wall time, peak RSS, .pte size for each exporter) and draws the same
three quantities against parameter count, one line per exporter (matplotlib: ``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

QUANTITIES = (("wall_s", "export wall time (s)"), ("peak_rss_gb", "peak RSS (GB)"), ("pte_mb", ".pte size (MB)"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="folders holding report.json")
    ap.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    args = ap.parse_args()
    reports = sorted((json.loads((run / "report.json").read_text()) for run in args.runs),
                     key=lambda r: r["parameters"])
    exporters = sorted({name for r in reports for name in r["results"]})
    header = "| model | parameters | quant | " + " | ".join(
        f"{e} {label.split(' (')[0]}" for e in exporters for _, label in QUANTITIES) + " |"
    print(header + "\n|" + "---|" * (3 + len(exporters) * len(QUANTITIES)))
    for r in reports:
        cells = [str(r["results"].get(e, {}).get(key, "—")) for e in exporters for key, _ in QUANTITIES]
        print(f"| {r['preset']} | {r['parameters'] / 1e6:.0f}M | {r['quant']} | " + " | ".join(cells) + " |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(QUANTITIES), figsize=(4.2 * len(QUANTITIES), 3.6))
        for ax, (key, label) in zip(axes, QUANTITIES):
            for e in exporters:
                points = [(r["parameters"] / 1e6, r["results"][e][key]) for r in reports if e in r["results"]]
                ax.plot(*zip(*points), marker="o", label=e)
                for r in reports:
                    if e in r["results"] and e == exporters[-1]:
                        ax.annotate(f"{r['preset']} {r['quant']}", (r["parameters"] / 1e6, r["results"][e][key]),
                                    fontsize=7, xytext=(3, 3), textcoords="offset points")
            ax.set_xlabel("parameters (M)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle("Export cost against model size (xnnpack, this 2-core machine)")
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
