"""``python -m exporters.report <sweep folder>``: rebuild a sweep's summary from its job folders.

Hydra writes the summary at the end of every ``-m`` run (``exporters.sweeps.callbacks``); this command
rebuilds it, e.g. for a sweep that was interrupted or ran on a cluster. The library is
:mod:`exporters.sweeps.summary`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from exporters.sweeps.summary import RESULT_FILE, SUMMARY_FILES, job_folders, write_summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m exporters.report",
                                 description="Rebuild summary.csv, summary.md and pareto.png of a sweep folder "
                                             "from its job folders.")
    ap.add_argument("sweep_dir", type=Path, help="the folder of a -m run (hydra.sweep.dir)")
    args = ap.parse_args(argv)
    if not args.sweep_dir.is_dir():
        raise SystemExit(f"{args.sweep_dir}: no such folder. Give the folder of a sweep (outputs/multirun/<time>).")
    if not any(job_folders(args.sweep_dir)):
        raise SystemExit(f"{args.sweep_dir} holds no job folders (each has .hydra/ or {RESULT_FILE}): is it the "
                         "folder of a -m run?")
    rows = write_summary(args.sweep_dir)
    ok = sum(r.ok for r in rows)
    print(f"{len(rows)} jobs ({ok} ok, {len(rows) - ok} failed): "
          + ", ".join(str(args.sweep_dir / name) for name in SUMMARY_FILES))


if __name__ == "__main__":
    main()


def __getattr__(name: str) -> object:
    """The summary library (``JobRow``, ``write_summary``, ...) lived here in 0.1; it is in ``exporters.sweeps.summary``."""
    import exporters.sweeps.summary as summary

    if hasattr(summary, name):
        return getattr(summary, name)
    raise AttributeError(f"module 'exporters.report' has no attribute {name!r}")
