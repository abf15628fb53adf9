"""Wall time of the same sweep on each launcher: one after another, joblib processes, a local Ray cluster.

    python -m benchmarks.sweep_launchers --out /tmp/launchers model=hf model.checkpoint=<dir> quant=fp32,8da8w,8da4w
    python -m benchmarks.sweep_launchers --out /tmp/launchers --launchers serial,joblib \\
        --preset smollm2 --layers 8 quant=fp32,8da4w

Every argument that is not an option of this tool is a Hydra override passed to each sweep as it is;
``--preset NAME`` (benchmarks/presets.py) adds the overrides that export that model (its checkpoint folder is
written into ``--out``). Runs the sweeps one at a time (measure alone), each into ``<out>/<launcher>``, and writes
``<out>/launchers.md``: wall time, jobs ok/failed, the sum of the jobs' own times, and the speed-up over the
serial run. The jobs' numbers of each sweep are in its ``summary.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.presets import add_preset_arguments, preset_of, preset_overrides
from exporters.sweeps.summary import read_rows

REPO = Path(__file__).resolve().parent.parent
LAUNCHERS = {"serial": [], "joblib": ["hydra/launcher=local_parallel"], "ray": ["hydra/launcher=ray_cluster"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="a folder for the sweeps (keep its path short for Ray)")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS),
                    help=f"comma-separated, of {', '.join(LAUNCHERS)} (default: all)")
    add_preset_arguments(ap, default=None)
    args, overrides = ap.parse_known_args()
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        ap.error(f"unknown options {' '.join(unknown)} (Hydra overrides are key=value)")
    launchers = args.launchers.split(",")
    if not set(launchers) <= set(LAUNCHERS):
        ap.error(f"--launchers {args.launchers}: each one of {', '.join(LAUNCHERS)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.preset:
        overrides = [*preset_overrides(preset_of(args), out / "checkpoint"), *overrides]
    results = {}
    for name in launchers:
        sweep = out / name
        cmd = [sys.executable, "-m", "exporters.llm", "-m", *LAUNCHERS[name], *overrides, f"hydra.sweep.dir={sweep}"]
        print(f"{name}: {' '.join(cmd[3:])}", flush=True)
        start = time.perf_counter()
        with open(out / f"{name}.log", "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"the {name} sweep failed (exit {proc.returncode}); see {out / f'{name}.log'}")
        wall = time.perf_counter() - start
        rows = read_rows(sweep)
        results[name] = (wall, sum(r.ok for r in rows), len(rows), sum(r.job_s or 0 for r in rows))
        print(f"  {wall:.0f} s, {results[name][1]} of {len(rows)} ok", flush=True)
    serial = results.get("serial", (None,))[0]
    lines = [f"Sweep: {' '.join(overrides)}", "",
             "| launcher | wall s | jobs ok | sum of job times s | speed-up over serial |", "|---|---:|---:|---:|---:|"]
    for name, (wall, ok, total, job_sum) in results.items():
        lines.append(f"| {name} | {wall:.0f} | {ok}/{total} | {job_sum:.0f} | "
                     f"{'' if serial is None else f'{serial / wall:.2f}x'} |")
    (out / "launchers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
